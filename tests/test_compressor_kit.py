"""The conformance kit: every registered compressor keeps every law; broken plugins are caught."""
import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.base import Compressor, Context, check_dtypes
from mergecomp.compressors.testing import CHECKS, Report, check_compressor
from mergecomp.compressors import testing as kit

#: (compressor, check) pairs that fail for reasons outside the compressors fixed here.
#: (compressor, check) pairs known to fail, with the reason: none today.
KNOWN = {}


def cases():
    for name in compressors.available():
        for check in CHECKS:
            marks = [pytest.mark.xfail(reason=KNOWN[name, check], strict=False)] if (name, check) in KNOWN else []
            yield pytest.param(name, check, marks=marks, id=f"{name}-{check}")


@pytest.mark.parametrize("name, check", cases())
def test_every_registered_compressor_keeps_every_law(name, check):
    CHECKS[check](compressors.get(name))


@pytest.mark.parametrize("name, kwargs", [
    ("randk", dict(compress_ratio=0.25, unbiased=True, seed=3)),
    ("terngrad", dict(clip=2.5, bucket_size=33)),
    ("qsgd", dict(levels=127, bucket_size=64, seed=9)),
    ("dgc", dict(compress_ratio=0.05, fp16_values=True, warmup=4, wire_format="indexed")),
    ("dgc", dict(compress_ratio=0.05, index_bits=64, wire_format="indexed")),
    ("topk", dict(compress_ratio=0.3)),
    ("topk", dict(compress_ratio=0.05, wire_format="tight8")),
    ("dgc", dict(compress_ratio=0.05, warmup=0, wire_format="tight8")),
    ("dgc", dict(compress_ratio=0.005, warmup=0, wire_format="auto")),
    ("topk", dict(compress_ratio=0.002, wire_format="auto")),
    ("graddrop", dict(compress_ratio=0.1, sample_survivors=50)),
    ("graddrop", dict(compress_ratio=0.1, wire_format="tight8")),
    ("signum", dict(beta=0.0)),
])
def test_options_keep_the_laws(name, kwargs):
    report = check_compressor(compressors.get(name), kwargs=kwargs, samples=1000)
    assert isinstance(report, Report) and report.passed == list(CHECKS)
    assert name in str(report).lower()


def test_an_instance_is_checked_as_given_and_left_alone():
    qsgd = compressors.create("qsgd", seed=5)
    before = qsgd.state_dict()
    report = check_compressor(qsgd, samples=300)
    assert report.compressor == "QSGDCompressor(levels=7, bucket_size=128, seed=5)"
    assert qsgd.state_dict() == before


def test_the_kit_leaves_the_global_random_state_alone():
    torch.manual_seed(42)
    state = torch.get_rng_state()
    check_compressor(compressors.get("randk"), skip=["unbiased"])
    assert torch.equal(torch.get_rng_state(), state)


def test_skip_names_must_exist():
    with pytest.raises(ValueError, match="unknown checks \\['speed'\\]"):
        check_compressor(compressors.get("none"), skip=["speed"])


# --- plugins that break one law each ------------------------------------------------------------

class HalfSign(Compressor):
    """Sign scaled by half the mean magnitude, with no wire formula.  Wire: n + 4 bytes."""

    unbiased = False

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1) / 2 if flat.numel() else flat.new_zeros(1)
        return (torch.sign(flat).to(torch.int8), scale.float()), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        signs, scale = payload
        return (signs.to(ctx.dtype) * scale.to(ctx.dtype)).view(ctx.shape)


def test_a_plugin_without_a_wire_formula_is_told_so():
    report = check_compressor(HalfSign)
    assert any("wire formula unchecked: HalfSign has no wire_nbytes" in note for note in report.notes)
    assert any("layout unchecked" in note for note in report.notes)
    assert "wire_size" in report.passed  # ran, found nothing to compare


class WrongWire(HalfSign):
    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        return numel + 4 + 1


class ClaimsSummable(HalfSign):
    summable = True

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        return numel + 4


class ClaimsFixedSize(HalfSign):
    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        return (flat[flat != 0],), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx.numel, dtype=ctx.dtype)
        return out.view(ctx.shape)


class OverItsBound(HalfSign):
    def payload_bound(self, ctx):
        return (torch.Size([max(0, ctx.numel - 1)]), torch.Size([1]))


class HiddenArgument(HalfSign):
    def __init__(self, scale: float = 0.5):
        self._scale = scale


class RankInRepr(HalfSign):
    def __repr__(self):
        return f"RankInRepr(rank={self.process_rank})"


class FirstElement(HalfSign):
    def compress(self, tensor, name):
        tensor.reshape(-1)[0]  # IndexError on an empty tensor
        return super().compress(tensor, name)


class CrashesOnNaN(HalfSign):
    def compress(self, tensor, name):
        if torch.isnan(tensor).any():
            raise RuntimeError("selected index k out of range")
        return super().compress(tensor, name)


class UnstagedCounter(HalfSign):
    """Counts its steps in place: a rollback cannot undo that."""

    def __init__(self):
        self.steps = 0

    def compress(self, tensor, name):
        self.steps += 1
        payload, ctx = super().compress(tensor, name)
        return (payload[0], payload[1] + self.steps), ctx

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class ScaledTooLittle(Compressor):
    """rand-k that claims to be unbiased but scales by 0.7·n/k."""

    unbiased = True

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        keep = torch.rand(flat.numel()) < 0.5
        return (torch.where(keep, flat * 2 * 0.7, torch.zeros_like(flat)),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return payload[0].view(ctx.shape)


class AlwaysFloat32(HalfSign):
    def decompress(self, payload, ctx):
        return super().decompress(payload, ctx).float()


class RankInContext(HalfSign):
    """Its context carries this rank's own scale: other ranks' payloads decode wrongly."""

    def compress(self, tensor, name):
        (signs, scale), ctx = super().compress(tensor, name)
        return (signs,), _ScaleContext(ctx.shape, ctx.dtype, scale)

    def decompress(self, payload, ctx):
        return (payload[0].to(ctx.dtype) * ctx.scale.to(ctx.dtype)).view(ctx.shape)


from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class _ScaleContext(Context):
    scale: torch.Tensor


@pytest.mark.parametrize("plugin, check, law", [
    (WrongWire, "wire_size", r"\[wire size\] WrongWire\(\) on gaussian float32 tensor of shape \(1,\).* sends 5 bytes, "
                             r"wire_nbytes\(\) says 6"),
    (ClaimsSummable, "summable", r"\[summable\] ClaimsSummable\(\) on .*: decode\(sum of payloads\) differs"),
    (ClaimsFixedSize, "fixed_size", r"\[fixed_size\] .* payload shapes differ for the same numel"),
    (OverItsBound, "payload_bound", r"\[payload_bound\] .* payload part 0 has shape \(1,\), over its bound \(0,\)"),
    (HiddenArgument, "repr", r"\[repr\] HiddenArgument\(\) .* does not name the constructor arguments \['scale'\]"),
    (RankInRepr, "repr", r"\[repr\] .* repr depends on the process rank"),
    (FirstElement, "edge_tensors", r"\[edge tensors\] .* zeros float32 tensor of shape \(0,\).* raised IndexError"),
    (CrashesOnNaN, "non_finite", r"\[non-finite input\] .* nan float32 tensor .* raised RuntimeError: selected index"),
    (UnstagedCounter, "state", r"\[state\] UnstagedCounter\(\) .*: state_dict\(\) in the middle of a step differs"),
    (UnstagedCounter, "non_finite", r"\[non-finite input\] .* state_dict\(\) after rollback\(\) differs"),
    (ScaledTooLittle, "unbiased", r"\[unbiased\] .* the mean decode of coordinate \d+ is"),
    (AlwaysFloat32, "round_trip", r"\[round trip\] .* float64 tensor .* decoded Tensor torch.float32"),
    (RankInContext, "shared_context", r"\[shared context\] .* rank 1's .* decodes differently"),
])
def test_a_broken_law_is_named_with_the_compressor_and_the_inputs(plugin, check, law):
    with pytest.raises(AssertionError, match=law):
        CHECKS[check](plugin)
    with pytest.raises(AssertionError, match=rf"^\[[a-z_ -]+\] {plugin.__name__}\("):  # the first law it breaks
        check_compressor(plugin, samples=400)


def test_the_unbiasedness_check_accepts_what_it_should_and_is_reproducible():
    honest = compressors.get("randk")
    kit.check_unbiased(honest, kwargs=dict(compress_ratio=0.5, unbiased=True), samples=1500)
    with pytest.raises(AssertionError) as first:
        kit.check_unbiased(ScaledTooLittle, samples=1500)
    with pytest.raises(AssertionError) as second:
        kit.check_unbiased(ScaledTooLittle, samples=1500)
    assert str(first.value) == str(second.value)


# --- check_dtypes ---------------------------------------------------------------------------------

def test_check_dtypes_names_the_compressor_the_dtype_and_the_way_out():
    topk = compressors.create("topk")
    check_dtypes(topk, [torch.float32, torch.float16, torch.bfloat16, torch.float64])
    with pytest.raises(ValueError, match=r"TopKCompressor\(compress_ratio=0.035, warmup='auto', warmup_steps=0, wire_format='auto'\) cannot carry complex64 gradients "
                                         r"\(it carries float16, bfloat16, float32, float64\); only the 'none'/'fp32' "
                                         r"compressor carries complex gradients: .*torch.view_as_real.* raw"):
        check_dtypes(topk, [torch.float32, torch.complex64])
    with pytest.raises(ValueError, match="cannot carry int64 gradients .* integer and bool tensors have no gradient"):
        check_dtypes(compressors.create("qsgd"), [torch.int64])
    check_dtypes(compressors.create("none"), [torch.complex128, torch.float32])
    check_dtypes(HalfSign(), [torch.float32])  # a plugin inherits the real floats


@pytest.mark.parametrize("name", compressors.available())
def test_every_compressor_declares_its_dtypes_and_unbiasedness(name):
    cls = compressors.get(name)
    assert set(cls.supported_dtypes) >= {torch.float32}
    if name != "powersgd":  # declared in its own file
        assert isinstance(cls.unbiased, bool), f"{name} does not say whether it is unbiased"
