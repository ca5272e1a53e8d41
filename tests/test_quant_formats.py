"""Quantized formats: exact dequantization, packed byte layouts, fp8 rounding, activation
quantization, the clipping and GPTQ searches (quant/)."""
from __future__ import annotations

import numpy as np
import pytest

from infeng_common.errors import InfengError
from infeng_compiler.quant.act import fake_quant, quantize_act
from infeng_compiler.quant.formats import (
    QUANT_FORMATS,
    ROWS_PER_BLOCK,
    QuantizedTensor,
    e4m3_decode,
    e4m3_encode,
    get_format,
)
from infeng_compiler.quant.gptq import gptq_quantize
from infeng_compiler.quant.search import quantize

SHAPES = [(64, 64), (172, 64), (64, 172), (5, 34), (33, 256)]


def _weights(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_pack_unpack_round_trip(name: str) -> None:
    fmt = get_format(name)
    for shape in SHAPES:
        qt = quantize(_weights(shape), fmt)
        data = qt.pack()
        assert data.dtype == np.uint8 and data.size == fmt.nbytes(shape)
        assert fmt.nbytes(shape) % 64 == 0
        back = fmt.unpack(data, shape)
        assert np.array_equal(back.codes, qt.codes)
        assert np.array_equal(back.scales.view(np.uint8), qt.scales.view(np.uint8))
        if fmt.asym:
            assert np.array_equal(back.zeros, qt.zeros)
        if fmt.mins:
            assert np.array_equal(back.mins.view(np.uint16), qt.mins.view(np.uint16))
        assert np.array_equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_dequantize_is_the_documented_formula(name: str) -> None:
    fmt = get_format(name)
    shape = (33, 100)
    qt = quantize(_weights(shape, 1), fmt)
    G = qt.codes.shape[1] if fmt.group == 0 else fmt.group
    scale = np.repeat(qt.scales.astype(np.float32), G, axis=1)
    if fmt.kind == "fp8":
        expect = e4m3_decode(qt.codes) * scale
    elif fmt.mins:                          # llama.cpp's Q4_1: (d * q) + m in float32
        expect = qt.codes.astype(np.float32) * scale + np.repeat(qt.mins.astype(np.float32), G, axis=1)
    else:
        zero = np.repeat(qt.zeros.astype(np.float32), G, axis=1) if fmt.asym else np.float32(fmt.zero)
        expect = (qt.codes.astype(np.float32) - zero) * scale
    out = qt.dequantize()
    assert out.dtype == np.float32 and out.shape == shape
    assert np.array_equal(out, expect[:, :shape[1]].astype(np.float32))
    assert np.abs(out - _weights(shape, 1)).max() <= np.abs(_weights(shape, 1)).max() * (0.2 if fmt.bits == 4 else 0.07)
    if fmt.mins:                            # padding columns meet zero activations only
        return
    # padding columns decode to exactly zero
    full = (qt.codes.astype(np.float32) - (zero if fmt.kind == "int" else 0)) if fmt.kind == "int" else e4m3_decode(qt.codes)
    assert not full[:, shape[1]:].any()


def test_bits_per_weight() -> None:
    assert get_format("q4g32").bits_per_weight((64, 64)) == 4.5
    assert get_format("q4g64").bits_per_weight((64, 128)) == 4.25
    assert get_format("q8g32").bits_per_weight((64, 64)) == 8.5
    assert get_format("q8r").bits_per_weight((64, 576)) == 8 + 32 / 576
    assert get_format("f8e4m3").bits_per_weight((64, 576)) == 8 + 32 / 576
    assert get_format("q4g64a").bits_per_weight((64, 256)) == 4 + 24 / 64
    assert get_format("q4g32").padding((172, 64)) == {"N": 176, "K": 64}
    assert get_format("q4g32").padding((64, 172)) == {"N": 64, "K": 192}
    assert get_format("q8r").padding((64, 172)) is None


def _grid(shape, fmt):
    """A quantized tensor whose code at (n, k) is a recognisable function of (n, k)."""
    N, K = shape
    kp, ng = fmt.padded_k(K), fmt.groups(K)
    n, k = np.meshgrid(np.arange(N), np.arange(kp), indexing="ij")
    codes = ((n * 7 + k * 3) % (fmt.umax + 1)).astype(np.uint8)
    scales = (np.arange(N * ng).reshape(N, ng) + 1).astype(fmt.scale_dtype)
    zeros = ((np.arange(N * ng).reshape(N, ng) * 5) % 16).astype(np.uint8) if fmt.asym else None
    mins = (-np.arange(N * ng).reshape(N, ng) / 4).astype(np.float16) if fmt.mins else None
    return QuantizedTensor(fmt.name, shape, codes, scales, zeros, mins)


def test_layout_int4_nibbles_rows_interleaved() -> None:
    fmt = get_format("q4g32a")
    qt = _grid((20, 64), fmt)
    data = qt.pack()
    block = fmt.block_bytes(64)
    for n in (0, 5, 15, 16, 19):
        for k in (0, 3, 4, 7, 8, 33, 63):
            b, r = divmod(n, ROWS_PER_BLOCK)
            oct_, j = divmod(k, 8)
            byte = data[b * block + oct_ * 64 + r * 4 + (j % 4)]
            nibble = (byte >> 4) if j >= 4 else (byte & 0xF)
            assert nibble == qt.codes[n, k], (n, k)
    # scales after the codes, [group][row] fp16; zero points after the scales, [group][row]
    codes_bytes = 16 * 64 // 2
    for n, g in ((0, 0), (3, 1), 15 and (15, 1)):
        off = codes_bytes + (g * 16 + n) * 2
        assert data[off:off + 2].view(np.float16)[0] == qt.scales[n, g]
        assert data[codes_bytes + 2 * 16 * 2 + g * 16 + n] == qt.zeros[n, g]
    # rows past N (16 * 2 - 20 of them) are zero: zero scales
    second = data[block:2 * block]
    assert not second[codes_bytes:codes_bytes + 64].view(np.float16).reshape(2, 16)[:, 4:].any()


@pytest.mark.parametrize("name,segments", [("q4g32", [2, 2, 1]), ("q4g32a", [4, 1]), ("q4g64", [2, 1]),
                                           ("q4g32m", [1, 1, 1, 1, 1])])
def test_layout_int4_segments(name: str, segments: list[int]) -> None:
    """int4 blocks are segments of 2 (symmetric), 4 (asymmetric) or 1 (minimums) groups: their codes,
    then their scales, then their zero points or minimums, each segment 64-byte padded, so a block
    reads in address order."""
    fmt = get_format(name)
    K = 160 if fmt.group == 32 else 192                     # 5 groups of 32, or 3 of 64
    qt = _grid((16, K), fmt)
    data = qt.pack()
    assert [n for _, n in fmt.segments(K)] == segments
    at, g = 0, 0
    for n in segments:
        for gi in range(n):
            for r, k in ((0, 0), (7, 5), (15, fmt.group - 1)):
                oct_, j = divmod(k, 8)
                byte = data[at + gi * fmt.group_code_bytes + oct_ * 64 + r * 4 + (j % 4)]
                assert ((byte >> 4) if j >= 4 else (byte & 0xF)) == qt.codes[r, (g + gi) * fmt.group + k]
            meta = at + n * fmt.group_code_bytes
            for r in (0, 9, 15):
                assert data[meta + (gi * 16 + r) * 2:][:2].view(np.float16)[0] == qt.scales[r, g + gi]
                if fmt.asym:
                    assert data[meta + n * 32 + gi * 16 + r] == qt.zeros[r, g + gi]
                if fmt.mins:
                    assert data[meta + n * 32 + (gi * 16 + r) * 2:][:2].view(np.float16)[0] == qt.mins[r, g + gi]
        at += fmt.segment_bytes(n)
        assert at % 64 == 0
        g += n
    assert at == fmt.block_bytes(K) == data.size


def test_layout_int8_signed_k_pairs() -> None:
    fmt = get_format("q8r")
    qt = _grid((16, 10), fmt)
    data = qt.pack()
    for n in range(16):
        for k in range(10):
            pair, j = divmod(k, 2)
            assert data[pair * 32 + n * 2 + j].astype(np.int8) == int(qt.codes[n, k]) - 128
    scales = data[16 * 10:16 * 10 + 64].view(np.float32)
    assert np.array_equal(scales, qt.scales[:, 0])


def test_layout_fp8_one_k_of_16_rows() -> None:
    fmt = get_format("f8e4m3")
    qt = quantize(_weights((16, 6)), fmt)
    data = qt.pack()
    assert np.array_equal(data[:96].reshape(6, 16).T, qt.codes)


def test_e4m3_rounding_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 50, rng.standard_normal(2000) * 0.01,
                        np.array([0.0, -0.0, 448, -448, 2 ** -9, 3 * 2 ** -10, 0.0625 + 2 ** -8, 17.0, 19.0])]
                       ).astype(np.float32)
    # every tie between neighbouring codes
    values = e4m3_decode(np.arange(0x7E, dtype=np.uint8))
    x = np.concatenate([x, ((values[:-1] + values[1:]) / 2).astype(np.float32)])
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(e4m3_encode(x), ref)
    assert e4m3_encode(np.array([1e6, -1e6], np.float32)).tolist() == [0x7E, 0xFE]   # saturates


def test_activation_quantization_definition() -> None:
    x = np.random.default_rng(2).standard_normal((3, 70)).astype(np.float32)
    x[1, 40] = 25.0
    q, d, sums = quantize_act(x, 32, 8)
    assert q.dtype == np.int8 and q.shape == (3, 96) and d.shape == (3, 3)
    blocks = np.zeros((3, 96), np.float32)
    blocks[:, :70] = x
    amax = np.abs(blocks.reshape(3, 3, 32)).max(axis=2)
    assert np.array_equal(d, (amax / np.float32(127)).astype(np.float32))
    assert np.abs(q).max() == 127 and not q[:, 70:].any()
    assert np.array_equal(sums, q.reshape(3, 3, 32).astype(np.int32).sum(axis=2))
    err = np.abs(fake_quant(x, 32, 8) - x).reshape(3, -1)
    assert (err[:, :64].reshape(3, 2, 32) <= d[:, :2, None] / 2 * (1 + 1e-6)).all()
    q16, d16, _ = quantize_act(x, 0, 16)
    assert q16.dtype == np.int16 and d16.shape == (3, 1) and np.abs(q16).max() == 32767
    assert np.abs(fake_quant(x, 0, 16) - x).max() <= d16.max() / 2 * (1 + 1e-6)
    assert not quantize_act(np.zeros((1, 32), np.float32))[0].any()


@pytest.mark.parametrize("name", ["q4g32", "q4g64a", "q8r", "f8e4m3"])
def test_clipping_search_never_worse(name: str) -> None:
    fmt = get_format(name)
    w = _weights((48, 128), 3)
    w[:, 5] *= 8                                                  # an outlier column
    x = np.random.default_rng(4).standard_normal((512, 128)).astype(np.float32)
    gram = x.T.astype(np.float64) @ x
    rtn = quantize(w, fmt, search=False).dequantize()
    by_weight = quantize(w, fmt).dequantize()
    by_output = quantize(w, fmt, gram=gram).dequantize()
    assert ((by_weight - w) ** 2).sum() <= ((rtn - w) ** 2).sum() + 1e-12
    out_err = lambda d: float(np.einsum("nk,kl,nl->", d - w, gram, d - w))  # noqa: E731
    if fmt.group:                                # full per-group output error is what the search minimises
        assert out_err(by_output) <= out_err(rtn) * (1 + 1e-9)


@pytest.mark.parametrize("name", ["q4g32", "q8r"])
def test_gptq_reduces_output_error(name: str) -> None:
    fmt = get_format(name)
    rng = np.random.default_rng(5)
    w = _weights((32, 96), 6)
    x = rng.standard_normal((1024, 96)).astype(np.float32) @ (np.eye(96) + 0.3 * rng.standard_normal((96, 96)))
    gram = x.T.astype(np.float64) @ x / len(x)
    out_err = lambda qt: float(np.einsum("nk,kl,nl->", qt.dequantize() - w, gram, qt.dequantize() - w))  # noqa: E731
    g = gptq_quantize(w, fmt, gram)
    assert g.pack().size == fmt.nbytes(w.shape)
    assert out_err(g) < out_err(quantize(w, fmt, gram=gram))


def test_unknown_format() -> None:
    with pytest.raises(InfengError, match="unknown quantized format 'q3g32'.*q4g32"):
        get_format("q3g32")
    with pytest.raises(InfengError):
        get_format("q8r_a")


@pytest.mark.parametrize("name", ["q4g32", "q4g64", "q4g128", "q8g32", "q8r"])
@pytest.mark.parametrize("weighted", ["none", "diagonal", "gram"])
def test_clip_search_in_c_chooses_as_numpy(name: str, weighted: str) -> None:
    """codegen/clip_search.py picks the candidate numpy's search picks: same codes and scales, on
    rows that are no multiple of its 16-group blocks, with zero rows, without calibration, weighted
    by the Gram's diagonal, and by a full Gram (each group's G x G block; its diagonal for the
    per-row q8r). The errors differ from numpy's only in the order of float64 sums, so a tie
    broken differently would show here as a differing code."""
    from infeng_compiler.codegen.clip_search import clip_search

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((37, 200)) * 0.02).astype(np.float32)
    w[3] = 0
    w[5, :40] *= 30                                          # an outlier group
    x = rng.standard_normal((300, 200)) * (rng.random(200) * 3)  # correlated channels of unequal size
    gram = {"none": None, "diagonal": rng.random(200) + 0.1, "gram": x.T @ x / 300}[weighted]
    numpy_choice = quantize(w, name, gram=gram)
    c_choice = quantize(w, name, gram=gram, symmetric_choice=clip_search)
    np.testing.assert_array_equal(c_choice.codes, numpy_choice.codes)
    np.testing.assert_array_equal(c_choice.scales, numpy_choice.scales)


def test_search_cache_returns_what_the_search_chose(tmp_path) -> None:
    """A second search of the same weight, format and options reads the first one's result; a
    changed weight, format, method or Gram matrix searches again."""
    from infeng_compiler.quant.search_cache import SearchCache, search_key

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 64)) * 0.02).astype(np.float32)
    cache = SearchCache(tmp_path)
    searched: list[str] = []

    def search(fmt: str = "q4g32"):
        searched.append(fmt)
        return quantize(w, fmt)

    first = cache.get_or_search(search_key(w, "q4g32", "clip", None), search)
    again = cache.get_or_search(search_key(w, "q4g32", "clip", None), search)
    assert searched == ["q4g32"] and cache.hits == 1
    for field in ("codes", "scales"):
        np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    assert (again.format, again.shape, again.zeros, again.mins) == (first.format, first.shape, None, None)
    keys = {search_key(w, "q4g32", "clip", None), search_key(w + 1e-3, "q4g32", "clip", None),
            search_key(w, "q4g64", "clip", None), search_key(w, "q4g32", "gptq", None),
            search_key(w, "q4g32", "clip", np.eye(64))}
    assert len(keys) == 5
    assert SearchCache(None).get_or_search("unused", search) is not None and searched == ["q4g32", "q4g32"]
