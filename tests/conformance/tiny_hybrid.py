"""A tiny hybrid model for the SGLang v2 end-to-end check: attention layers interleaved with a Mamba-like
recurrent layer, written in plain torch (seeded random weights, float32, CPU; nothing is downloaded).

Layers: attention, recurrent, attention, recurrent. Attention is causal with rotary positions (2 heads of
32). The recurrent layer is Mamba's selective-scan shape: an input projection, a causal depthwise conv
(kernel 4, so its state is the last 3 inputs), a diagonal state-space recurrence ``h = exp(dt*A) * h +
dt * B x`` with a ``[d_inner, d_state]`` state, and a gated output. Its state after a prefix is what
SGLang's ``MambaPoolHost`` keeps per radix node: a conv state and a temporal (SSM) state per layer.

A suffix prefilled from a restored state - the attention KV of the prefix pages and the recurrent
states at the prefix's last page boundary - gives the logits of a full prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

VOCAB = 512
HIDDEN = 64
HEADS = 2
HEAD_DIM = 32
D_INNER = 128
D_STATE = 16
CONV_KERNEL = 4
KINDS = ("attention", "recurrent", "attention", "recurrent")
ATTENTION_LAYERS = KINDS.count("attention")
RECURRENT_LAYERS = KINDS.count("recurrent")


@dataclass
class State:
    """What a continuation needs: per attention layer its K and V ``[tokens, heads, head_dim]``; per
    recurrent layer its conv state ``[D_INNER, CONV_KERNEL - 1]`` and SSM state ``[D_INNER, D_STATE]``."""

    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    conv: list[torch.Tensor] = field(default_factory=list)
    ssm: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.kv[0][0].shape[0]) if self.kv else 0


def empty_state() -> State:
    return State(
        kv=[(torch.zeros(0, HEADS, HEAD_DIM), torch.zeros(0, HEADS, HEAD_DIM)) for _ in range(ATTENTION_LAYERS)],
        conv=[torch.zeros(D_INNER, CONV_KERNEL - 1) for _ in range(RECURRENT_LAYERS)],
        ssm=[torch.zeros(D_INNER, D_STATE) for _ in range(RECURRENT_LAYERS)],
    )


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[tokens, heads, head_dim]`` at absolute ``positions``."""
    half = HEAD_DIM // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        start, n = past[0].shape[0], x.shape[0]
        positions = torch.arange(start, start + n)
        q, k, v = self.qkv(x).view(n, 3, HEADS, HEAD_DIM).unbind(1)
        q, k = _rotate(q, positions), _rotate(k, positions)
        keys, values = torch.cat([past[0], k]), torch.cat([past[1], v])
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(HEAD_DIM)
        visible = torch.arange(start + n)[None, :] <= positions[:, None]  # causal over the whole history
        scores = scores.masked_fill(~visible[None], float("-inf"))
        mixed = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return self.out(mixed.reshape(n, HEADS * HEAD_DIM)), (keys, values)


class Recurrent(nn.Module):
    """Mamba-like: causal depthwise conv, then a selective diagonal state-space scan, gated."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(HIDDEN, 2 * D_INNER, bias=False)
        self.conv = nn.Parameter(torch.randn(D_INNER, CONV_KERNEL) / CONV_KERNEL)
        self.dt_proj = nn.Linear(D_INNER, D_INNER)
        self.b_proj = nn.Linear(D_INNER, D_STATE, bias=False)
        self.c_proj = nn.Linear(D_INNER, D_STATE, bias=False)
        self.a_log = nn.Parameter(torch.log(torch.linspace(0.5, 4.0, D_STATE)).repeat(D_INNER, 1))
        self.skip = nn.Parameter(torch.ones(D_INNER))
        self.out = nn.Linear(D_INNER, HIDDEN, bias=False)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, gate = self.in_proj(x).chunk(2, dim=-1)  # [tokens, D_INNER] each
        window = torch.cat([conv_state.T, u])  # the last CONV_KERNEL - 1 inputs, then these
        conv_out = torch.stack([(window[t : t + CONV_KERNEL].T * self.conv).sum(-1) for t in range(u.shape[0])])
        u = nn.functional.silu(conv_out)
        dt = nn.functional.softplus(self.dt_proj(u))  # [tokens, D_INNER]
        a = -torch.exp(self.a_log)  # [D_INNER, D_STATE]
        b, c = self.b_proj(u), self.c_proj(u)  # [tokens, D_STATE]
        h, ys = ssm_state, []
        for t in range(u.shape[0]):
            h = torch.exp(dt[t, :, None] * a) * h + (dt[t] * u[t])[:, None] * b[t][None, :]
            ys.append(h @ c[t] + self.skip * u[t])
        y = torch.stack(ys) * nn.functional.silu(gate)
        return self.out(y), window[-(CONV_KERNEL - 1) :].T.contiguous(), h


class TinyHybrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in KINDS)
        self.mixers = nn.ModuleList(Attention() if kind == "attention" else Recurrent() for kind in KINDS)
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)


def load_model(seed: int = 0) -> TinyHybrid:
    torch.manual_seed(seed)
    return TinyHybrid().eval()


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=gen)]


@torch.no_grad()
def forward(model: TinyHybrid, ids: list[int], state: State | None = None) -> tuple[torch.Tensor, State]:
    """Logits ``[1, len(ids), VOCAB]`` for ``ids`` continuing ``state`` (a fresh start when None), and the
    state after them; ``state`` itself is not changed."""
    state = state or empty_state()
    x = model.embed(torch.tensor(ids))
    new = State()
    attention_index = recurrent_index = 0
    for kind, norm, mixer in zip(KINDS, model.norms, model.mixers, strict=True):
        if kind == "attention":
            mixed, kv = mixer(norm(x), state.kv[attention_index])
            new.kv.append(kv)
            attention_index += 1
        else:
            mixed, conv, ssm = mixer(norm(x), state.conv[recurrent_index], state.ssm[recurrent_index])
            new.conv.append(conv)
            new.ssm.append(ssm)
            recurrent_index += 1
        x = x + mixed
    return model.head(model.final_norm(x))[None], new


def prefill_by_pages(model: TinyHybrid, ids: list[int], page_size: int) -> list[State]:
    """Prefill ``ids`` a page at a time (chunked prefill); the state at the end of every full page."""
    states: list[State] = []
    state: State | None = None
    for start in range(0, len(ids) - len(ids) % page_size, page_size):
        _, state = forward(model, ids[start : start + page_size], state)
        states.append(state)
    return states
