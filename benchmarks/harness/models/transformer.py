"""A small decoder-only transformer language model (GPT-style).

Vaswani et al., "Attention Is All You Need", NeurIPS 2017, with the decoder-only, pre-norm
layout of Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019:
token and learned position embeddings, ``num_layers`` pre-LayerNorm self-attention blocks with
a causal mask, final LayerNorm, linear head.  Defaults (4 layers, d_model 256, 4 heads, vocab
10000, 64-token sequences) give 8.4M parameters, many of them in medium-sized matrices: a
parameter-size profile between the CNNs and the LSTM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .spec import SEQUENCE_UNIT, ModelSpec, check_positive_int, check_probability, language_model_loss, register, token_batch

DEFAULT_VOCAB_SIZE = 10000
DEFAULT_SEQ_LEN = 64


class TransformerLanguageModel(nn.Module):
    """Causal transformer LM: ``(B, T)`` ids, ``T <= max_seq_len``, to ``(B, T, V)`` logits."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE, d_model: int = 256,
                 num_heads: int = 4, num_layers: int = 4, ff_size: Optional[int] = None,
                 dropout: float = 0.1, max_seq_len: int = 512):
        super().__init__()
        for what, value in (("vocab_size", vocab_size), ("d_model", d_model),
                            ("num_heads", num_heads), ("num_layers", num_layers),
                            ("max_seq_len", max_seq_len)):
            check_positive_int(what, value)
        if d_model % num_heads:
            raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model} "
                             f"and num_heads={num_heads}")
        ff_size = 4 * d_model if ff_size is None else check_positive_int("ff_size", ff_size)
        check_probability("dropout", dropout)
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, num_heads, ff_size, dropout,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model),
                                            enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)
        for embedding in (self.token_embedding, self.position_embedding):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, seq_len), got shape "
                             f"{tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len="
                             f"{self.max_seq_len}; build the model with a larger max_seq_len")
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.token_embedding(tokens) + self.position_embedding(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device,
                                                              dtype=x.dtype)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def transformer(vocab_size: int = DEFAULT_VOCAB_SIZE, d_model: int = 256, num_heads: int = 4,
                num_layers: int = 4, ff_size: Optional[int] = None, dropout: float = 0.1,
                max_seq_len: int = 512) -> TransformerLanguageModel:
    """The benchmark transformer LM (8.4M parameters with the defaults)."""
    return TransformerLanguageModel(vocab_size, d_model, num_heads, num_layers, ff_size,
                                    dropout, max_seq_len)


def text_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
               seq_len: int = DEFAULT_SEQ_LEN, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Synthetic batch: ``(B, 64)`` token ids and next-token targets."""
    return token_batch(batch_size, device, generator, seq_len=seq_len, vocab_size=vocab_size)


TRANSFORMER = register(ModelSpec("transformer", SEQUENCE_UNIT, transformer, text_batch,
                                 language_model_loss, default_batch_size=16,
                                 description="4-layer causal transformer LM, d_model 256, "
                                             "vocab 10000, 64 tokens"))
