"""Fakes of SGLang 0.5.23's host pools for a hybrid model, page_first layout, CPU.

The real ``MHATokenToKVPoolHost`` (pool_host/mha.py) and ``MambaPoolHost`` (pool_host/mamba.py) cannot be
imported here: their modules import ``sglang.srt.mem_cache.memory_pool``, which pulls SGLang's MoE layers,
DeepGEMM wrappers and configs (torchvision, sgl_kernel), none of which install on a CPU-only machine. These
fakes have the real classes' buffers (same shapes, same order) and the real ``get_page_buffer_meta``
pointer arithmetic, which is all the HiCache backend reads.
"""

from __future__ import annotations

import torch


class FakeMHATokenToKVPoolHost:
    """``MHATokenToKVPoolHost``, page_first: ``kv_buffer[2, size, layer_num, head_num, head_dim]``; per
    page one K and one V object, each ``[page_size, layer_num, head_num, head_dim]`` contiguous."""

    layout = "page_first"

    def __init__(self, pages: int, page_size: int, layer_num: int, head_num: int, head_dim: int) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layer_num, head_num, head_dim
        self.dtype = torch.float32
        self.size = pages * page_size
        self.kv_buffer = torch.zeros((2, self.size, layer_num, head_num, head_dim), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        token_bytes = self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        v_offset = self.size * token_bytes
        base, ptrs = self.kv_buffer.data_ptr(), []
        for i in range(0, len(indices), self.page_size):
            k_ptr = base + int(indices[i]) * token_bytes
            ptrs += [k_ptr, k_ptr + v_offset]
        return ptrs, [self.page_size * token_bytes] * len(ptrs)

    def slots(self, first_page: int, pages: int) -> torch.Tensor:
        """Host indices (token slots) of ``pages`` pages from slot page ``first_page``."""
        start = first_page * self.page_size
        return torch.arange(start, start + pages * self.page_size, dtype=torch.int64)

    def store(self, first_slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy per-layer K, V ``[tokens, heads, dim]`` into slots from ``first_slot`` (the device-to-host
        backup SGLang does before writing through)."""
        span = slice(first_slot, first_slot + kv[0][0].shape[0])
        for layer, (k, v) in enumerate(kv):
            self.kv_buffer[0, span, layer] = k
            self.kv_buffer[1, span, layer] = v

    def load(self, first_slot: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = slice(first_slot, first_slot + tokens)
        return [
            (self.kv_buffer[0, span, layer].clone(), self.kv_buffer[1, span, layer].clone())
            for layer in range(self.layer_num)
        ]


class FakeMambaPoolHost:
    """``MambaPoolHost``, page_first: one state slot a page (``page_size`` 1), ``temporal_buffer[size,
    layers, 1, *temporal_shape]`` and one ``conv_buffer[size, layers, 1, *conv_shape]`` per conv state; per
    slot the objects temporal, conv_0, ..."""

    layout = "page_first"
    page_size = 1

    def __init__(self, slots: int, layers: int, temporal_shape: tuple[int, ...], conv_shape: tuple[int, ...]) -> None:
        self.size = slots
        self.num_mamba_layers = layers
        self.temporal_dtype = self.conv_dtype = self.dtype = torch.float32
        self.temporal_buffer = torch.zeros((slots, layers, 1, *temporal_shape), dtype=self.temporal_dtype)
        self.conv_buffer = [torch.zeros((slots, layers, 1, *conv_shape), dtype=self.conv_dtype)]
        self.temporal_state_elem_size = int(torch.Size(temporal_shape).numel())
        self.conv_state_elem_sizes = [int(torch.Size(conv_shape).numel())]
        self.kv_buffer = [self.temporal_buffer, *self.conv_buffer]  # the real init_kv_buffer's list

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        layers = self.num_mamba_layers
        temporal_size = self.page_size * layers * self.temporal_dtype.itemsize * self.temporal_state_elem_size
        conv_sizes = [self.page_size * layers * self.conv_dtype.itemsize * n for n in self.conv_state_elem_sizes]
        ptrs: list[int] = []
        sizes: list[int] = []
        for i in range(0, len(indices), self.page_size):
            slot = int(indices[i])
            ptrs.append(
                self.temporal_buffer.data_ptr()
                + slot * layers * self.temporal_state_elem_size * self.temporal_dtype.itemsize
            )
            sizes.append(temporal_size)
            for buffer, elems, size in zip(self.conv_buffer, self.conv_state_elem_sizes, conv_sizes, strict=True):
                ptrs.append(buffer.data_ptr() + slot * layers * elems * self.conv_dtype.itemsize)
                sizes.append(size)
        return ptrs, sizes

    def store(self, slot: int, ssm: list[torch.Tensor], conv: list[torch.Tensor]) -> None:
        for layer, (temporal, conv_state) in enumerate(zip(ssm, conv, strict=True)):
            self.temporal_buffer[slot, layer, 0] = temporal
            self.conv_buffer[0][slot, layer, 0] = conv_state

    def load(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layers = range(self.num_mamba_layers)
        return (
            [self.temporal_buffer[slot, layer, 0].clone() for layer in layers],
            [self.conv_buffer[0][slot, layer, 0].clone() for layer in layers],
        )
