"""CIFAR-10 from its "python version" files, with the usual augmentation done in torch.

Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", 2009.  The archive
``cifar-10-python.tar.gz`` (:data:`DOWNLOAD_URL`) unpacks to ``cifar-10-batches-py/``:
``data_batch_1`` ... ``data_batch_5`` (10,000 training images each), ``test_batch``
(10,000 test images) and ``batches.meta``.  Each batch is a pickled dict whose ``b"data"``
is an N x 3072 uint8 array (one 32x32 image per row: the red, green and blue planes of
1024 bytes each, every plane row-major) and whose ``b"labels"`` holds N integers in
[0, 10); ``batches.meta`` holds the class names in ``b"label_names"``.

Pickles can run code when loaded, so the files are read with an unpickler that rebuilds
numpy arrays, bytes, lists and dicts and refuses anything else.

Augmentation as in He et al., "Deep Residual Learning for Image Recognition", CVPR 2016,
section 4.2: pad 4 zero pixels on every side, crop a random 32x32 window, flip it
horizontally with probability 1/2.  Then every channel is normalised by the training set's
mean and standard deviation.  Both act on whole uint8 batches with tensor indexing, on the
batch's device (torchvision is not needed).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

DOWNLOAD_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
ARCHIVE_FOLDER = "cifar-10-batches-py"
TRAIN_PREFIX = "data_batch_"
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class ImageSplit:
    """One split: ``images`` uint8 ``(N, 3, 32, 32)``, ``labels`` int64 ``(N,)``."""

    images: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return self.labels.numel()


@dataclass(frozen=True)
class Cifar10:
    """Both splits, the class names and the folder they came from."""

    train: ImageSplit
    test: ImageSplit
    label_names: Tuple[str, ...]
    folder: str
    train_files: Tuple[str, ...]


def find_folder(data_dir: str) -> str:
    """The folder holding the batch files: ``data_dir`` itself or its ``cifar-10-batches-py``.

    FileNotFoundError names what is missing and where the files come from.
    """
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"CIFAR-10 data directory {data_dir!r} does not exist; download "
                                f"{DOWNLOAD_URL}, unpack it there (tar xzf) and pass that folder")
    for folder in (data_dir, os.path.join(data_dir, ARCHIVE_FOLDER)):
        if os.path.isfile(os.path.join(folder, TRAIN_PREFIX + "1")):
            return folder
    raise FileNotFoundError(
        f"no CIFAR-10 batches in {data_dir!r}: expected {TRAIN_PREFIX}1 ... {TRAIN_PREFIX}5, "
        f"{TEST_FILE} and {META_FILE} there or in {os.path.join(data_dir, ARCHIVE_FOLDER)!r} "
        f"(the python version, {DOWNLOAD_URL}, unpacked with tar xzf)")


def load_cifar10(data_dir: str) -> Cifar10:
    """Read the training batches ``data_batch_1``, ``data_batch_2``, ... (as many as there
    are, consecutively numbered; the real set has 5), ``test_batch`` and ``batches.meta``."""
    folder = find_folder(data_dir)
    train_files = []
    for number in range(1, 100):
        path = os.path.join(folder, f"{TRAIN_PREFIX}{number}")
        if not os.path.isfile(path):
            break
        train_files.append(path)
    later = sorted(name for name in os.listdir(folder) if name.startswith(TRAIN_PREFIX)
                   and os.path.join(folder, name) not in train_files)
    if later:
        raise FileNotFoundError(f"{os.path.join(folder, TRAIN_PREFIX)}{len(train_files) + 1} is "
                                f"missing but {later} exist: the download is incomplete; unpack "
                                f"{DOWNLOAD_URL} again")
    for required in (TEST_FILE, META_FILE):
        if not os.path.isfile(os.path.join(folder, required)):
            raise FileNotFoundError(f"{os.path.join(folder, required)} is missing: the download is "
                                    f"incomplete; unpack {DOWNLOAD_URL} again")
    label_names = read_label_names(os.path.join(folder, META_FILE))
    parts = [read_batch(path, len(label_names)) for path in train_files]
    train = ImageSplit(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))
    test = read_batch(os.path.join(folder, TEST_FILE), len(label_names))
    return Cifar10(train, test, label_names, folder, tuple(os.path.basename(p) for p in train_files))


def read_batch(path: str, num_classes: int = NUM_CLASSES) -> ImageSplit:
    """One batch file as uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``.

    ValueError, naming the file, when the data is not N x 3072 uint8 or a label is out of
    [0, num_classes).
    """
    entry = _read_pickle(path)
    data, labels = _field(entry, "data", path), _field(entry, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != PIXELS:
        described = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
                     else type(data).__name__)
        raise ValueError(f"{path}: 'data' must be an N x {PIXELS} uint8 array (32x32 RGB planes "
                         f"per row), got a {described}; is this a CIFAR-10 python-version file?")
    labels = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    if labels.dim() != 1 or labels.numel() != data.shape[0]:
        raise ValueError(f"{path}: {data.shape[0]} images but labels of shape {tuple(labels.shape)}")
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ValueError(f"{path}: labels must be in [0, {num_classes}), found "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    images = torch.from_numpy(np.ascontiguousarray(data)).view(-1, *IMAGE_SHAPE)
    return ImageSplit(images, labels)


def read_label_names(path: str) -> Tuple[str, ...]:
    """The class names of ``batches.meta`` (``b"label_names"``), decoded as UTF-8."""
    names = _field(_read_pickle(path), "label_names", path)
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"{path}: 'label_names' must be a non-empty list, got {names!r}")
    return tuple(n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names)


def channel_statistics(images: Tensor, chunk: int = 4096) -> Tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation of uint8 images, in [0, 1] units (float32).

    Accumulated in float64 over chunks, so the whole set is never copied as floats.
    """
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty uint8 batch (N, C, H, W), got {images.dtype} "
                         f"of shape {tuple(images.shape)}")
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for start in range(0, images.shape[0], chunk):
        part = images[start:start + chunk].to(torch.float64) / 255.0
        total += part.sum(dim=(0, 2, 3))
        squares += part.square().sum(dim=(0, 2, 3))
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(0).sqrt()
    if bool((std == 0).any()):
        raise ValueError(f"a channel of these images is constant (std {std.tolist()}): "
                         f"normalising by it would divide by zero")
    return mean.float(), std.float()


def normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 ``(N, C, H, W)`` to float32 ``(x / 255 - mean) / std`` per channel, on the
    images' device."""
    mean = mean.to(images.device).view(1, -1, 1, 1)
    std = std.to(images.device).view(1, -1, 1, 1)
    return (images.to(torch.float32) / 255.0 - mean) / std


def random_crop_flip(images: Tensor, generator: Optional[torch.Generator] = None,
                     padding: int = 4) -> Tensor:
    """Random ``H x W`` crops of the batch padded by ``padding`` zeros, each mirrored
    left-right with probability 1/2 (one draw per image from ``generator``, a CPU one).

    A flip is the crop's columns read backwards, so both are one indexing operation.
    """
    if images.dim() != 4:
        raise ValueError(f"expected a batch (N, C, H, W), got shape {tuple(images.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be a non-negative integer, got {padding!r}")
    n, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator)
    flip = torch.rand(n, 1, generator=generator) < 0.5
    rows = top + torch.arange(h)
    columns = left + torch.arange(w)
    columns = torch.where(flip, columns.flip(1), columns)
    device = images.device
    return padded[torch.arange(n, device=device).view(n, 1, 1, 1),
                  torch.arange(c, device=device).view(1, c, 1, 1),
                  rows.to(device).view(n, 1, h, 1),
                  columns.to(device).view(n, 1, 1, w)]


# ----------------------------------------------------------------------------- pickles

# numpy's array rebuilders (protocols up to 4, and 5), whatever module this numpy keeps them in
_RECONSTRUCT = np.array(0).__reduce__()[0]
_FROMBUFFER = np.array(0).__reduce_ex__(5)[0]
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # the real files (numpy 1.x)
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # re-pickled by numpy 2.x
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,  # protocol 5
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): __import__("codecs").encode,  # bytes pickled by Python 3, protocol 2
}


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuild numpy arrays and plain containers only; refuse every other global."""

    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing {module}.{name}: a CIFAR-10 batch holds only numpy arrays, bytes, "
                f"lists and dicts") from None


def _read_pickle(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            entry = _ArrayUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as error:
        raise ValueError(f"{path} is not a readable CIFAR-10 python-version batch: "
                         f"{error}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{path} should hold a dict, got {type(entry).__name__}")
    return entry


def _field(entry: dict, key: str, path: str):
    """``entry[b"key"]`` (the files' bytes keys) or ``entry["key"]`` (a re-pickled copy)."""
    for candidate in (key.encode(), key):
        if candidate in entry:
            return entry[candidate]
    raise ValueError(f"{path} has no {key!r} entry (keys: {sorted(map(repr, entry))})")
