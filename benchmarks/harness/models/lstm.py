"""Two-layer LSTM language model on a Penn Treebank-sized vocabulary.

Zaremba, Sutskever, Vinyals, "Recurrent Neural Network Regularization", 2014: embedding,
two LSTM layers, dropout between them, linear decoder to the vocabulary.  ``hidden_size=650``
is the paper's "medium" model (dropout 0.5, 19.8M parameters), ``hidden_size=1500`` the
"large" one (dropout 0.65, 66M parameters); vocabulary 10000 and 35-step sequences as in PTB.
This is the model of PyTorch's word_language_model example and of the MergeComp paper.

For data-parallel benchmarking a forward starts from a zero hidden state unless it is given
one: each step is then independent of the previous one, every rank can run any batch, and no
state has to be detached or kept in sync.  Training on a text stream carries the state from
one BPTT window to the next instead (``model(tokens, state, return_state=True)``, detaching
the returned state between windows), as examples/train_language_model.py does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .spec import SEQUENCE_UNIT, ModelSpec, check_positive_int, check_probability, language_model_loss, register, token_batch

PTB_VOCAB_SIZE = 10000
PTB_SEQ_LEN = 35


class LSTMLanguageModel(nn.Module):
    """Embedding → multi-layer LSTM → decoder; input ``(B, T)`` ids, output ``(B, T, V)``.

    ``tie_weights`` shares the embedding and decoder matrices (Press, Wolf 2017; Inan et al.
    2017); it requires ``embedding_size == hidden_size``.  Off by default, as in the
    MergeComp benchmark, so that the model keeps its two large tensors.
    """

    def __init__(self, vocab_size: int = PTB_VOCAB_SIZE, hidden_size: int = 650,
                 num_layers: int = 2, dropout: float = 0.5,
                 embedding_size: Optional[int] = None, tie_weights: bool = False):
        super().__init__()
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_layers", num_layers)
        check_probability("dropout", dropout)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        if tie_weights and embedding_size != hidden_size:
            raise ValueError(f"tie_weights needs embedding_size == hidden_size, got "
                             f"{embedding_size} and {hidden_size}; drop tie_weights or make "
                             f"them equal")
        self.drop = nn.Dropout(dropout)
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.lstm = nn.LSTM(embedding_size, hidden_size, num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        if not tie_weights:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor, state: Optional[Tuple[Tensor, Tensor]] = None,
                return_state: bool = False):
        """Logits ``(B, T, V)``; with ``return_state``, ``(logits, (h, c))``.

        ``state`` is the ``(h, c)`` pair of ``nn.LSTM`` (each ``(num_layers, B, hidden)``)
        that the previous window returned; None starts from zeros.
        """
        if tokens.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, seq_len), got shape "
                             f"{tuple(tokens.shape)}")
        embedded = self.drop(self.embedding(tokens))
        output, new_state = self.lstm(embedded, state)
        logits = self.decoder(self.drop(output))
        return (logits, new_state) if return_state else logits


def lstm(vocab_size: int = PTB_VOCAB_SIZE, hidden_size: int = 650, num_layers: int = 2,
         dropout: Optional[float] = None, tie_weights: bool = False) -> LSTMLanguageModel:
    """The PTB LSTM LM; dropout defaults to the paper's 0.5 (medium) or 0.65 (large)."""
    if dropout is None:
        dropout = 0.65 if isinstance(hidden_size, int) and hidden_size >= 1500 else 0.5
    return LSTMLanguageModel(vocab_size, hidden_size, num_layers, dropout,
                             tie_weights=tie_weights)


def ptb_batch(batch_size: int, device="cpu", generator: Optional[torch.Generator] = None, *,
              seq_len: int = PTB_SEQ_LEN, vocab_size: int = PTB_VOCAB_SIZE):
    """Synthetic PTB batch: ``(B, 35)`` token ids and next-token targets."""
    return token_batch(batch_size, device, generator, seq_len=seq_len, vocab_size=vocab_size)


LSTM = register(ModelSpec("lstm", SEQUENCE_UNIT, lstm, ptb_batch, language_model_loss,
                          default_batch_size=20,
                          description="2-layer LSTM LM, PTB vocab 10000, 35 steps, 19.8M "
                                      "parameters at hidden 650"))
