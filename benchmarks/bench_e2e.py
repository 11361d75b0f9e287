"""End to end: decode step time and tokens/s of a random-weight Llama-3.1-8B-shaped model.

Caches (``--caches``), every ratio against ``fp16_flash`` measured in the same run:

- ``fp16_flash``: the fp16 baseline. A preallocated cache layer (``[B, Hk, max_len, D]`` buffers)
  whose ``update`` writes in place and returns views of the valid prefix, so the decode SDPA runs
  the flash kernel with no mask and no copy; ``generate`` as users call it.
- ``fp16_dynamic``: transformers' ``DynamicCache`` (concatenates the whole cache every step).
- ``fp16_static``: transformers' ``StaticCache``, eager (``disable_compile``; a mask over max_len).
- ``fp16_static_compiled``: the same through transformers' auto-compile (``torch.compile``
  ``mode="reduce-overhead"``, CUDA graphs), the captured fp16 anchor people use. Compiling an
  8B-shaped model takes tens of seconds per shape, so it is not in the default list.
- ``fp16_static_graph``: ``StaticCache`` with the decode step captured in an explicit CUDA graph by
  :func:`kvarn.integrations.transformers.graph.decode_greedy` (the same capture as ``kvarn_graph``).
- ``fp16_flash_graph``: ``fp16_flash`` with every step captured in its own CUDA graph at that
  step's length and replayed once; only the replays are timed (the captures' host time is not).
  Not a way to decode (a graph per length), the bound of a captured fp16 flash step: exact
  lengths, flash SDPA, no host work.
- ``kvarn:PRESET``: fused kvarn (``attn_implementation="kvarn"`` over ``KVarNCache`` packed tiles)
  through ``generate``, eager.
- ``kvarn_graph:PRESET``: fused kvarn with reserved storage, decode step captured in CUDA graphs by
  ``decode_greedy`` (on CPU: its replay simulation); a flush step starts its encodes on a side stream.
- ``kvarn_graph_inline:PRESET``: the same with ``flush_ahead=False`` (each layer encodes inside its
  update, on the step's stream), to measure what the side stream saves.
- ``kvarn_auto_graph:PRESET``: ``kvarn_graph`` with kvarn-auto's layers (per-head frame flags read
  by the decode kernel). The history written straight into the cache brings no queries, so every
  head keeps KVarN's flavour (a warning per layer says so): the step's cost does not depend on the
  flags' values.

The history is written straight into each cache (random K/V, in chunks: speed does not depend on
values), then ``--new`` greedy tokens are generated; step time = median gap between per-step
events (CUDA events recorded by a logits processor or by ``decode_greedy``'s callback; no host
synchronization), skipping the first three steps. The history is ``context - new // 2`` tokens, so
that a kvarn tile completes in the middle of the measured steps: ``flush_step_ms`` is the step that
freezes it (its update encodes one tile per layer; under ``decode_greedy``'s default, the later
layers' encodes start in it, on a side stream), ``fill_step_ms`` the step before, whose token
completes the tile (where ``decode_greedy`` starts the first layers' encodes); ``freeze_over_median``
(the table's "freeze step") is the larger excess of the two over the median step. Under CUDA-graph capture the
first such steps also capture their graphs: with ``--new`` of twice the tile size and more (272 at
G 128) a second tile completes, and the last one is reported (``flush_steps_ms`` lists all).

Throughput at capacity (``--capacity-gib``): for each of ``--capacity-caches``, the largest batch
whose KV (spec section 4 bytes; kvarn with a full tile of tail beside the sink) fits in the budget
at ``--capacity-context`` is run and measured (``--capacity-max-batch`` caps it, for small checks).

Also: peak memory during decode and KV bytes (stored, reserved, spec section 4). Prints tables,
writes JSON, asserts nothing. On a CPU (``--device cpu --shape tiny``) it runs end to end at toy
sizes (kernels under triton's interpreter) to check the script, not to measure.

    PYTHONPATH=. python benchmarks/bench_e2e.py --out benchmarks/results/e2e.json
"""

from __future__ import annotations

import argparse
import json
import contextlib
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
ap.add_argument("--shape", default="llama8b", choices=["llama8b", "tiny"])
ap.add_argument("--contexts", nargs="*", type=int, default=[32768, 8192], help="none: only the capacity runs")
ap.add_argument("--batches", nargs="+", type=int, default=[16, 1])
ap.add_argument("--caches", nargs="+", default=[
    "fp16_flash", "fp16_dynamic", "fp16_static_graph", "kvarn:k4v2_g128", "kvarn:k2v2_g128",
    "kvarn_graph:k4v2_g128", "kvarn_graph:k2v2_g128"])
ap.add_argument("--new", type=int, default=16)
ap.add_argument("--fill-chunk", type=int, default=4096, help="history tokens written per cache update")
ap.add_argument("--capacity-gib", type=float, default=None, help="KV budget of the at-capacity runs (off by default)")
ap.add_argument("--capacity-context", type=int, default=32768)
ap.add_argument("--capacity-caches", nargs="+", default=["fp16_flash", "kvarn_graph:k4v2_g128", "kvarn_graph:k2v2_g128"])
ap.add_argument("--capacity-max-batch", type=int, default=None)
ap.add_argument("--out", default="benchmarks/results/e2e.json")
ARGS = ap.parse_args() if __name__ == "__main__" else None

if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels on CPU

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, StaticCache  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.integrations.transformers import attention as hf_attention, graph as hf_graph  # noqa: E402

GIB = 1 << 30
SHAPES = {
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


class FlashLayer(CacheLayerMixin):
    """fp16 K/V preallocated as ``[B, Hk, max_len, D]``; ``update`` writes in place and returns
    views of the valid prefix (no mask is needed for one query token, so SDPA picks flash)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len, self.length = max_len, 0

    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, h, self.max_len, d)
        self.values = torch.zeros_like(self.keys)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, q = self.length, key_states.shape[-2]
        if t + q > self.max_len:
            raise ValueError(f"FlashLayer holds {self.max_len} tokens; {t} + {q} exceeds it")
        self.keys[:, :, t:t + q] = key_states
        self.values[:, :, t:t + q] = value_states
        self.length = t + q
        return self.keys[:, :, :t + q], self.values[:, :, :t + q]

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return self.max_len

    def reset(self):
        self.length = 0


def build_model(shape: str, device: str):
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rope_theta=500000.0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    with torch.device(device):  # buffers (inv_freq) are not parameters: rebuild them for real
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


class StepClock(LogitsProcessor):
    """A timestamp per step (CUDA event, or host time on CPU), the peak memory of each step, and a
    host probe per step (the first fused layer's tile count, to find the step that froze a tile)."""

    def __init__(self, device, probe=None):
        self.cuda = device == "cuda"
        self.events, self.peaks, self.probes, self.probe = [], [], [], probe
        self.spans = []  # begin events paired with events[i] (fp16_flash_graph): gaps are then spans

    def tick(self, *_):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.peaks.append(torch.cuda.max_memory_allocated())  # an allocator counter: no sync
            torch.cuda.reset_peak_memory_stats()
        else:
            e = time.perf_counter()
        self.events.append(e)
        self.probes.append(self.probe() if self.probe else None)

    def __call__(self, input_ids, scores):
        self.tick()
        return scores

    def gaps_ms(self):
        if self.cuda and self.spans:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.spans, self.events)]
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.events, self.events[1:])]


FLASH_DECODE = "fp16_nomask_decode"  # no "flash" in it: transformers reads such names as flash-attn kernels


def flash_decode_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """Decode attention of ``fp16_flash_graph``: one query token per row and no padding, so every
    cached key is visible and no mask is needed; flash SDPA over the cache's views (transformers
    builds a mask when no attention_mask is passed, which flash refuses)."""
    if query.shape[2] != 1:
        raise ValueError(f"{FLASH_DECODE} serves one-token decode steps, got {query.shape[2]} query tokens")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def register_flash_decode():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(FLASH_DECODE, flash_decode_attention)
    AttentionMaskInterface.register(FLASH_DECODE, lambda *args, **kwargs: None)


def make_cache(model, kind: str, max_len: int):
    """(cache, decode: "generate" | "generate_compiled" | "graph" | "graph_inline" | "graph_per_step")."""
    name, _, preset = kind.partition(":")
    n_layers = model.config.num_hidden_layers
    if name == "fp16_flash_graph":
        register_flash_decode()
    attn = "kvarn" if name.startswith("kvarn") else FLASH_DECODE if name == "fp16_flash_graph" else "sdpa"
    model.set_attn_implementation(attn)
    if name in ("fp16_flash", "fp16_flash_graph"):
        return Cache(layers=[FlashLayer(max_len) for _ in range(n_layers)]), \
            "generate" if name == "fp16_flash" else "graph_per_step"
    if name == "fp16_dynamic":
        return DynamicCache(config=model.config), "generate"
    if name in ("fp16_static", "fp16_static_compiled", "fp16_static_graph"):
        mode = {"fp16_static": "generate", "fp16_static_compiled": "generate_compiled"}.get(name, "graph")
        return StaticCache(config=model.config, max_cache_len=max_len), mode
    if name == "kvarn" and preset:
        return hf_attention.fused_cache(model, preset), "generate"
    if name in ("kvarn_graph", "kvarn_graph_inline") and preset:
        return hf_attention.fused_cache(model, preset, max_length=max_len), \
            "graph" if name == "kvarn_graph" else "graph_inline"
    if name == "kvarn_auto_graph" and preset:
        return hf_attention.fused_cache(model, preset, max_length=max_len, method="kvarn-auto"), "graph"
    raise ValueError(f"unknown cache {kind!r}; valid: fp16_flash, fp16_flash_graph, fp16_dynamic, fp16_static, "
                     "fp16_static_compiled, fp16_static_graph, kvarn:PRESET, kvarn_graph:PRESET, "
                     "kvarn_graph_inline:PRESET, kvarn_auto_graph:PRESET")


def fill(cache, cfg, b, t, chunk, device):
    """Write t random history tokens into every layer, ``chunk`` tokens per update."""
    g = torch.Generator(device=device).manual_seed(0)
    hk, d = cfg.num_key_value_heads, cfg.head_dim
    dtype = torch.float16 if device == "cuda" else torch.float32
    for s in range(0, t, chunk):
        n = min(chunk, t - s)
        for i in range(cfg.num_hidden_layers):
            k = torch.randn(b, hk, n, d, device=device, dtype=dtype, generator=g)
            v = torch.randn(b, hk, n, d, device=device, dtype=dtype, generator=g)
            cache.update(k, v, i)
            del k, v
            layer = cache.layers[i]
            if hasattr(layer, "freeze"):
                layer.freeze()  # encode this layer's complete tiles now: one chunk of fp16 tail at a time


@torch.no_grad()
def decode_graph_per_step(model, cache, input_ids, new, clock):
    """``new`` greedy tokens, step i captured at its own length and replayed once (``fp16_flash_graph``);
    ``clock`` gets an event pair around each replay (``clock.spans``), so capture time is not counted."""
    start = cache.get_seq_length()
    logits = model(input_ids=input_ids, position_ids=torch.tensor([[start]], device=input_ids.device),
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    ids = logits[:, -1:].argmax(-1)
    pos = torch.full((1, 1), start + 1, dtype=torch.long, device=input_ids.device)

    def step():
        out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        ids.copy_(out[:, -1:].argmax(-1))
        pos.add_(1)

    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (workspaces) outside capture: one eager step
        step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2, new):
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        clock.tick()
        clock.spans.append(begin)
        del graph


def spec_bytes(kind: str, cfg, b: int, t: int, full_tail: bool = False) -> int:
    """Spec section 4 bytes of t tokens: records for full tiles past the sink, fp16 sink + tail."""
    per_tok = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp16 K + V
    if not kind.startswith("kvarn"):
        return b * t * per_tok
    c = KVarNConfig.from_name(kind.split(":")[1])
    n = max(0, t - c.sink_tokens) // c.tile
    fp_tokens = t - n * c.tile + (c.tile if full_tail else 0)
    return b * (cfg.num_hidden_layers * cfg.num_key_value_heads * n * c.record_bytes(cfg.head_dim) + fp_tokens * per_tok)


def kv_bytes(kind, cache, cfg, b, t):
    if kind.startswith("kvarn"):
        rep = cache.memory_report()["total"]
        return rep["total_bytes"], rep["reserved_bytes"]
    stored = spec_bytes(kind, cfg, b, t)
    reserved = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
    return stored, reserved


def run_one(model, kind, b, context, new, chunk, device):
    cuda = device == "cuda"
    cfg = model.config
    t = context - new // 2  # a kvarn tile completes mid-run (see the module docstring)
    if cuda:
        torch.cuda.empty_cache()
    cache, decode = make_cache(model, kind, t + new + 8)
    fill(cache, cfg, b, t, chunk, device)
    stored, reserved = kv_bytes(kind, cache, cfg, b, t)
    ids = torch.randint(0, 1000, (b, t + 1), device=device)
    fused = [layer for layer in getattr(cache, "layers", []) if isinstance(layer, hf_attention.FusedKVarNLayer)]
    clock = StepClock(device, probe=(lambda: fused[0].store.counts[0]) if fused else None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    # The fp16 baseline is read by flash SDPA: pinned, so a dispatcher choice cannot slow it silently
    # (an error row instead, if flash refuses the inputs).
    flash = cuda and kind in ("fp16_flash", "fp16_flash_graph")
    backend = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext()
    with torch.no_grad(), backend:
        if decode == "graph_per_step":
            if not cuda:
                raise ValueError("fp16_flash_graph needs CUDA graphs (--device cuda)")
            decode_graph_per_step(model, cache, ids[:, -1:], new, clock)
        elif decode in ("graph", "graph_inline"):
            hf_graph.decode_greedy(model, cache, ids[:, -1:], new, capture="cuda" if cuda else "simulate",
                                   on_step=clock.tick, flush_ahead=decode == "graph")
        else:
            model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           logits_processor=[clock], attention_mask=torch.ones_like(ids),
                           disable_compile=decode != "generate_compiled", pad_token_id=0)
    gaps = clock.gaps_ms()
    steady = gaps[3:] if not clock.spans else gaps[1:]  # spans: the warm-up and the first token are not in them
    step = statistics.median(steady)
    row = {"cache": kind, "batch": b, "context": context, "history": t, "new": new,
           "step_ms": step, "tokens_per_s": b / step * 1e3, "gaps_ms": gaps,
           "allocated_before_gib": before / GIB, "kv_gib": stored / GIB, "kv_reserved_gib": reserved / GIB,
           "kv_spec_gib": spec_bytes(kind, cfg, b, t) / GIB}
    if cuda:
        row.update(peak_gib=max(clock.peaks + [torch.cuda.max_memory_allocated()]) / GIB,
                   peak_later_steps_gib=max(clock.peaks[1:]) / GIB)
    # Steps whose update froze a tile (gaps[i - 1] ends at step i's event). Under capture the first
    # of them also captures the freeze graph; the last one reported is a replay when there are two.
    flushed = [i for i in range(1, len(clock.probes)) if clock.probes[i] != clock.probes[i - 1] and i - 1 < len(gaps)]
    if flushed and cuda and decode in ("graph", "graph_inline") and len(flushed) < 2:
        # The run's only freeze also captured its graphs: its steps time the capture, not a freeze
        # (a simulated capture on CPU records no graph: its steps are eager ones, reported below).
        row.update(flush_steps=flushed, freeze_note="the only freeze also captured its graphs; --new >= 2 tiles")
    elif flushed:
        i = flushed[-1]
        row.update(flush_steps=flushed, flush_steps_ms=[gaps[j - 1] for j in flushed], flush_step=i,
                   flush_step_ms=gaps[i - 1], flush_over_median=gaps[i - 1] / step - 1)
        if i >= 2:  # the step whose token completed the tile (where decode_greedy starts its encode)
            row.update(fill_step_ms=gaps[i - 2], fill_over_median=gaps[i - 2] / step - 1,
                       freeze_over_median=max(gaps[i - 2], gaps[i - 1]) / step - 1)
    del cache
    return row


def capacity_batch(kind, cfg, t, budget_gib, cap):
    per_seq = spec_bytes(kind, cfg, 1, t, full_tail=True)
    b = int(budget_gib * GIB // per_seq)
    return max(1, min(b, cap) if cap else b)


def safe_run(*a):
    try:
        return run_one(*a)
    except Exception as exc:  # a failed row is reported, the others still run
        model, kind, b, context = a[:4]
        if a[-1] == "cuda":
            torch.cuda.empty_cache()
        return {"cache": kind, "batch": b, "context": context, "error": f"{type(exc).__name__}: {exc}"[:400]}


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_tables(rows, cap_rows):
    def base_of(r, name):
        for x in rows + cap_rows:
            if x["cache"] == name and x["context"] == r["context"] and x["batch"] == r["batch"] and "step_ms" in x:
                return x["step_ms"] / r["step_ms"]
        return None

    statics = ("fp16_static_graph", "fp16_static_compiled")  # the captured StaticCache anchor, either
    if rows:
        print("| context | B | cache | step ms | tokens/s | vs fp16_flash | vs fp16_flash_graph (bound) | "
              "vs StaticCache captured | freeze step | peak GiB | KV GiB stored (spec) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            print(f"| {r['context']} | {r['batch']} | {r['cache']} | {r['error'][:60]} | | | | | | | |")
            continue
        static = next((base_of(r, a) for a in statics if base_of(r, a) is not None), None)
        fl = r.get("freeze_over_median", r.get("flush_over_median"))
        print(f"| {r['context']} | {r['batch']} | {r['cache']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{_fmt(base_of(r, 'fp16_flash'), '.2f')}x | {_fmt(base_of(r, 'fp16_flash_graph'), '.2f')}x | "
              f"{_fmt(static, '.2f')}x | "
              f"{'-' if fl is None else f'{100 * fl:+.1f}%'} | {_fmt(r.get('peak_gib'), '.1f')} | "
              f"{r['kv_gib']:.2f} ({r['kv_spec_gib']:.2f}) |")
    if cap_rows:
        ok = [r for r in cap_rows if "step_ms" in r]
        fp = next((r for r in ok if r["cache"] == "fp16_flash"), None)
        print("\nAt capacity:")
        print("| cache | context | B (largest that fits) | step ms | tokens/s | vs fp16_flash tokens/s | peak GiB |")
        print("|---|---|---|---|---|---|---|")
        for r in cap_rows:
            if "step_ms" not in r:
                print(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['error'][:60]} | | | |")
                continue
            ratio = r["tokens_per_s"] / fp["tokens_per_s"] if fp else None
            print(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{_fmt(ratio, '.2f')}x | {_fmt(r.get('peak_gib'), '.1f')} |")


def main(a):
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (use --device cpu --shape tiny for a check)")
    torch.manual_seed(0)
    hf_attention.register()
    model = build_model(a.shape, a.device)
    rows, cap_rows = [], []
    meta = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "shape": a.shape, "args": vars(a)}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

    def record(row, into):
        into.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "gaps_ms"}), flush=True)
        with open(a.out, "w") as fh:  # after every row: a run cut short keeps what it measured
            json.dump({**meta, "rows": rows, "capacity": cap_rows}, fh, indent=1)

    for t in a.contexts:
        for b in a.batches:
            for kind in a.caches:
                record(safe_run(model, kind, b, t, a.new, a.fill_chunk, a.device), rows)
    if a.capacity_gib:
        for kind in a.capacity_caches:
            b = capacity_batch(kind, model.config, a.capacity_context, a.capacity_gib, a.capacity_max_batch)
            row = safe_run(model, kind, b, a.capacity_context, a.new, a.fill_chunk, a.device)
            row["budget_gib"] = a.capacity_gib
            record(row, cap_rows)
    print_tables(rows, cap_rows)


if __name__ == "__main__":
    main(ARGS)
