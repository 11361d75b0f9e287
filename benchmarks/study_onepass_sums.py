"""Study: would the encoder's normalization sums on tensor cores keep the twin's tolerance? (issue 12)

The Triton encoder spends two thirds of a tile in the normalization loop, and that loop is at the
floor of its form (BENCHMARKS.md, freeze steps, session 21): each deviation is a two-pass sum on the
FMA pipe, three operations a value. Its sums are matrix-vector products of the fixed tile, so they
could run on tensor cores: a row's variance of ``X e`` is ``(X^2 e^2 - (X e)^2 / C) / (C - 1)``
(``e = exp(-a)``, the columns' scales), a column's alike with ``exp(-b)``, with ``X`` and ``X^2``
split once into pieces an MMA takes. That changes two things against the torch codec (the twin,
float64 two-pass deviations): the variance is one-pass, so it cancels where a row's mean is large
against its deviation, and the operands carry only their pieces' bits. This script emulates those
sums in torch on CPU (products of the pieces exact in fp32, as an MMA forms them, summed in fp32)
and encodes real K/V tiles of a bundled model (its prompt from a bundled corpus, wikitext-2 by
default) with them, against the twin:

- ``fp32``: the one-pass form alone, fp32 operands (what cancellation costs);
- ``bf16x3``: three bf16 pieces of each operand, the six products of pieces ``i + j <= 2``;
- ``fp16x2``: high and low fp16 halves (the tile scaled to a largest magnitude of 1, the scale
  vectors each by a power of two), the three products hi hi, hi lo, lo hi.

Per form and side (K, V): tiles whose best iterate differs from the twin's, and the twin's score gap
of the iterate kept (a tie is at most 1e-6, the kernel tests' allowance); at the twin's own best
iterate, the fp16 scales more than one ulp off and the codes that move, in parts per million (the
tests allow no scale off by more than one ulp, and 100 ppm of codes, each by one step); and the
relative error of the decoded tiles against the twin's. Prints a table, writes JSON. It measures
the arithmetic of a kernel not written yet, not a kernel.

    python benchmarks/study_onepass_sums.py --model smollm2-135m --out benchmarks/results/onepass_sums_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvarn import models
from kvarn.analysis.inputs import load_text
from kvarn.codec import _encode_one, _quantize_torch, kv_to_tiles, rotate_kv
from kvarn.config import KVarNConfig
from kvarn.normalize import Workspace, _apply, best_iterate, normalize_iterates
from kvarn.pack import unpack_codes
from kvarn.quantize import dequantize_rows

FORMS = ("fp32", "bf16x3", "fp16x2")
TIE = 1e-6  # tests/kernels/test_encode_tiles.py: SCORE_TIE


def pieces(x: torch.Tensor, form: str) -> list[torch.Tensor]:
    """``x`` (fp32) as the fp32 values of its MMA pieces, largest first."""
    if form == "fp32":
        return [x]
    dt, n = (torch.bfloat16, 3) if form == "bf16x3" else (torch.float16, 2)
    out, rest = [], x
    for _ in range(n):
        p = rest.to(dt).to(torch.float32)
        out.append(p)
        rest = rest - p
    return out


def _pow2_max(x: torch.Tensor, dims) -> torch.Tensor:
    """A power of two per slice that brings its largest magnitude to at most 1 (fp16 pieces)."""
    m = x.abs().amax(dim=dims, keepdim=True)
    return torch.exp2(torch.where(m > 0, torch.ceil(torch.log2(m)), torch.zeros_like(m)))


def matvec(xp: list[torch.Tensor], vp: list[torch.Tensor]) -> torch.Tensor:
    """``sum_c x[..., r, c] v[..., c]`` from pieces: the products of pieces ``i + j`` below the
    number of pieces, each product's sum in fp32."""
    n = max(len(xp), len(vp))
    out = None
    for i, xi in enumerate(xp):
        for j, vj in enumerate(vp):
            if i + j < n:
                s = (xi @ vj[..., :, None])[..., 0]
                out = s if out is None else out + s
    return out


class OnePass:
    """The passes :func:`kvarn.normalize.normalize_iterates` makes, as one-pass sums of MMA pieces
    (module docstring); ``quantize`` is the twin's."""

    form = "fp32"

    def __init__(self, x: torch.Tensor):
        self.fp16 = self.form == "fp16x2"
        self.s = _pow2_max(x, (-2, -1)) if self.fp16 else torch.ones_like(x[..., :1, :1])
        xs = x / self.s
        self.rows = (pieces(xs, self.form), pieces(xs * xs, self.form))
        xt = xs.transpose(-1, -2)
        self.cols = (pieces(xt, self.form), pieces(xt * xt, self.form))

    def _std(self, parts, w: torch.Tensor) -> torch.Tensor:
        """Unbiased std of ``x * w`` along the last axis of ``parts``' tile (one-pass)."""
        n = w.shape[-1]
        k = _pow2_max(w, (-1,)) if self.fp16 else torch.ones_like(w[..., :1])
        w1 = w / k
        s1 = matvec(parts[0], pieces(w1, self.form))
        s2 = matvec(parts[1], pieces(w1 * w1, self.form))
        var = ((s2 - s1 * s1 / n) / (n - 1)).clamp_min(0)
        return var.sqrt() * k * self.s[..., 0]

    def row_std(self, x, a, b):
        return self._std(self.rows, torch.exp(-a)) * torch.exp(-b)

    def both_std(self, x, a, b):
        return self._std(self.cols, torch.exp(-b)) * torch.exp(-a), self.row_std(x, a, b)

    @staticmethod
    def quantize(x, a, b, bits, quantile):
        return _quantize_torch(x, a, b, bits, quantile)


def passes_for(form: str):
    return type(f"OnePass_{form}", (OnePass,), {"form": form})


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -14))) - 10)


def side_report(x: torch.Tensor, bits: int, iters: int, quantile: float, form: str) -> dict:
    """One side's tiles ``x [N, R, C]`` encoded with ``form``'s sums against the twin (rows rounded
    over ``quantile`` ranges as the preset says)."""
    cls = passes_for(form)
    a_t, b_t, m_t = normalize_iterates(x, iters, Workspace(x))
    a_e, b_e, m_e = normalize_iterates(x, iters, cls(x))
    pick_t = _last_argmin(m_t)
    pick_e = _last_argmin(m_e)
    moved = pick_e != pick_t
    best = m_t.gather(1, pick_t[:, None])[:, 0]
    gap = (m_t.gather(1, pick_e[:, None])[:, 0] - best) / best  # the twin's score of the iterate kept
    # At the twin's best iterate: how far the emulated trajectory's scales are from the twin's.
    at = lambda t, p: t.gather(1, p[:, None, None].expand(-1, 1, t.shape[-1]))[:, 0]  # noqa: E731
    (ct, st, zt, colt), (ce, se, ze, cole) = (_encode_at(x, bits, quantile, at(a, pick_t), at(b, pick_t))
                                              for a, b in ((a_t, b_t), (a_e, b_e)))
    off = [((u.float() - v.float()).abs() > _ulp16(torch.maximum(u.float().abs(), v.float().abs()))).float()
           for u, v in ((st, se), (zt, ze), (colt, cole))]
    qt, qe = _codes(ct, bits).int(), _codes(ce, bits).int()
    # The encodings as the two codecs would store them (each its own best iterate): decoded error.
    err_t = _rel_err(_decode(_encode_one(x, bits, iters, quantile), bits), x)
    err_e = _rel_err(_decode(_encode_at(x, bits, quantile, *best_iterate(a_e, b_e, m_e)), bits), x)
    return {
        "tiles": x.shape[0], "best_moved": int(moved.sum()),
        "moved_worst_gap": float(gap[moved].max()) if moved.any() else 0.0,
        "moved_not_tie": int((gap[moved] > TIE).sum()),
        "scales_off_ulp": float(torch.cat([o.reshape(-1) for o in off]).mean()),
        "codes_moved": float((qt != qe).float().mean()), "codes_max_step": int((qt - qe).abs().max()),
        "log_scale_max_diff": float(max((at(a_t, pick_t) - at(a_e, pick_t)).abs().max(),
                                        (at(b_t, pick_t) - at(b_e, pick_t)).abs().max())),
        "rel_err_twin": err_t, "rel_err_form": err_e,
    }


def _last_argmin(m: torch.Tensor) -> torch.Tensor:
    """The best iterate's index per tile, ties to the later one (kvarn.normalize.best_iterate)."""
    flipped = m.flip(-1).argmin(-1)
    return m.shape[-1] - 1 - flipped


def _encode_at(x: torch.Tensor, bits: int, quantile: float, a: torch.Tensor, b: torch.Tensor):
    """The twin's fields of tiles ``x`` normalized with log-scales ``(a, b)``."""
    return _encode_one(x, bits, 0, quantile, normalized=(_apply(x, a, b), torch.exp(a), torch.exp(b)))


def _decode(enc, bits) -> torch.Tensor:
    """Reconstruct ``[N, R, C]`` tiles from (codes, row scale, row zero, col scale) of one side."""
    codes, scale, zero, col = enc
    return dequantize_rows(_codes(codes, bits), scale, zero) * col.float()[..., None, :]


def _codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, R, C]`` of a side's packed field (stored transposed, as kvarn.codec keeps them)."""
    return unpack_codes(packed.transpose(-1, -2), bits)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(models.MODEL_NAMES))
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens captured (whole tiles are used)")
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--text", default="wikitext2", help="a bundled corpus by name, or a text file")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--out", default="benchmarks/results/onepass_sums.json")
    a = ap.parse_args()
    if a.tokens < 1:
        raise SystemExit(f"--tokens {a.tokens}: give at least one tile of tokens")
    try:
        cfg = KVarNConfig.from_name(a.preset)
    except ValueError as exc:
        raise SystemExit(f"--preset {a.preset!r}: {exc}") from None
    torch.manual_seed(0)
    model, tok = models.load(a.model)
    try:
        text = load_text(a.text)
    except ValueError as exc:
        raise SystemExit(f"--text {a.text!r}: {exc}") from None
    kv = models.capture_kv(model, tok, text, a.tokens)
    t = kv[0][0].shape[2] // cfg.tile * cfg.tile
    if t == 0:
        raise SystemExit(f"--tokens {a.tokens}: the text gave fewer than {cfg.tile} tokens (one tile)")
    k = torch.cat([k[:, :, :t] for k, _ in kv], 1)  # layers stacked as heads: [1, L * Hk, T, D]
    v = torch.cat([v[:, :, :t] for _, v in kv], 1)
    kt, vt = kv_to_tiles(rotate_kv(k, cfg), rotate_kv(v, cfg), cfg.tile)
    kt, vt = kt.reshape(-1, *kt.shape[-2:]), vt.reshape(-1, *vt.shape[-2:])
    rows = []
    print("| form | side | tiles | best iterate moved (not a tie) | scales off > 1 ulp | codes moved (max step) "
          "| rel. error twin -> form |")
    print("|---|---|---|---|---|---|---|")
    for form in a.forms:
        for side, x, bits, q in (("K", kt, cfg.key_bits, cfg.quantiles[0]),
                                 ("V", vt, cfg.value_bits, cfg.quantiles[1])):
            r = side_report(x, bits, cfg.sinkhorn_iters, q, form)
            r.update(form=form, side=side)
            rows.append(r)
            print(f"| {form} | {side} | {r['tiles']} | {r['best_moved']} ({r['moved_not_tie']}) "
                  f"| {r['scales_off_ulp'] * 1e6:.1f} ppm | {r['codes_moved'] * 1e6:.1f} ppm ({r['codes_max_step']}) "
                  f"| {r['rel_err_twin']:.5f} -> {r['rel_err_form']:.5f} |", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"model": a.model, "tokens": t, "preset": a.preset, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
