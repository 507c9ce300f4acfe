"""numpy + ml_dtypes references of the sampler's weight-only quantization (`pdm_jax.sampler.quantize`), shared by
tests/test_sampler_quantize.py and tests/test_sampler_moe.py. Independent of qwix and JAX."""

import ml_dtypes
import numpy as np

#: mode -> (half range: scale = max|W| / half range, lowest and highest integer value); qwix's absmax convention.
INT_RANGES = {"int8": (127.5, -128, 127), "int4": (7.5, -8, 7), "int2": (1.5, -2, 1)}


def _scale(w, output_axes, divisor):
    reduce = tuple(i for i in range(w.ndim) if i not in output_axes)
    return (np.abs(w).max(axis=reduce, keepdims=True) / np.float32(divisor)).astype(np.float32)


def fp8_reference(w, output_axes):
    """``(qvalue float8_e4m3fn, scale f32)``: absmax over the non-output axes / 448, W / scale rounded to e4m3
    (nearest even); a zero channel keeps scale 0 and qvalue 0."""
    w = np.asarray(w, np.float32)
    scale = _scale(w, output_axes, 448.0)
    return (w / np.where(scale == 0, 1, scale)).astype(ml_dtypes.float8_e4m3fn), scale


def int_reference(w, output_axes, mode):
    """``(dequantized f32, tie bool, scale f32)`` of int8 / int4 / int2 (`INT_RANGES`): scale = max|W| / half range over
    the non-output axes, ``clip(round_half_even(W / scale), lo, hi) * scale``. ``tie`` marks a channel's extreme
    weights, which sit on +-half range: there the compiled program's f32 rounding of ``W * (1 / scale)`` picks
    between neighbouring integers, so a test accepts lo, lo + 1 or hi times the scale."""
    half, lo, hi = INT_RANGES[mode]
    w = np.asarray(w, np.float32)
    scale = _scale(w, output_axes, half)
    x = w / scale
    return np.clip(np.round(x), lo, hi).astype(np.float32) * scale, np.abs(np.abs(x) - half) < 1e-3, scale


def int_matches(got, w, output_axes, mode) -> np.ndarray:
    """Per element: ``got`` equals `int_reference` (rtol 1e-6), or is lo, lo + 1 or hi times the scale at a tie."""
    half, lo, hi = INT_RANGES[mode]
    want, tie, scale = int_reference(w, output_axes, mode)
    scale = np.broadcast_to(scale, want.shape)
    ok_tie = tie & (np.isclose(got, lo * scale, rtol=1e-6) | np.isclose(got, (lo + 1) * scale, rtol=1e-6)
                    | np.isclose(got, hi * scale, rtol=1e-6))
    return np.isclose(got, want, rtol=1e-6, atol=0) | ok_tie
