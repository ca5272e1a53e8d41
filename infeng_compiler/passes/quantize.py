"""Pass ``quantize(PRESET, key=value, ...)``: give every matrix a storage format by policy, choose
its codes and scales, and quantize the activations that feed integer weights.

    quantize(int4)                              q4g32 linears, q8r embedding/lm_head
    quantize(int4,group=64,asym)                q4g64a
    quantize(int8) / quantize(fp8)              q8r / f8e4m3
    quantize(int4,policy=quant.json)            per-tensor overrides (quant/policy.py)
    quantize(int4,calib=wiki.txt,calib_tokens=4096)   AWQ scaling + output-error clipping

Arguments: the preset (``int8``, ``int4``, ``fp8``) or ``policy=FILE`` (or both: the file refines
the preset); ``group=32|64|128``; ``asym``; ``embed=FORMAT`` (embedding / lm_head tables);
``calib=FILE``, ``calib_max_bytes=N``, ``calib_ctx=N`` (tokens per calibration chunk, default 256),
``calib_tokens=N`` (a budget: at most N tokens, whole chunks spread evenly over the text; absent or
0: every chunk, as before the budget, so that older manifests replay to the same bytes);
``clip=0`` turns the clipping search off (plain round-to-nearest); ``awq=0`` keeps calibration for
the clipping search only.

What it does, in order:
1. the policy assigns a format to every matrix read by ``linear``/``logits``/``embedding``;
2. with ``calib``: the float32 graph runs over the calibration text (the interpreter) collecting
   per-channel statistics of every matmul input; AWQ scales are searched and folded into the
   producing op (``quant/awq.py``, an exact transform in real arithmetic);
3. every weight is quantized with a per-group clipping search (``quant/search.py``) that minimises
   output error on the calibration statistics, or weight error without calibration; the chosen
   codes travel with the weight (``Weight.quant``), the format is ``attrs["format"]``;
4. every value read by a ``linear``/``logits`` with an integer weight goes through a
   ``quantize_act`` node, as the integer kernels compute: int8 per token in blocks of 32 for int4
   weights, int16 per token for int8 weights (int8 activations would double int8's error); the
   ``act-precision`` pass that follows in the default pipeline keeps f32 activations for
   decode-sized steps (``passes/act_precision.py``).

The interpreter then computes what the compiled model computes, up to the order of accumulation.
A summary of formats and bytes is left in ``PassContext.quant_report`` (the calibration token count in
``PassContext.calib_tokens``).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from infeng_common.errors import InfengError

from ..codegen.clip_search import clip_search
from ..ir import Graph, Node, print_graph
from ..quant.act import ACT_FORMS
from ..quant.calibrate import calibration_args
from ..quant.formats import get_format, is_quantized
from ..quant.policy import GROUPS, PRESETS, QuantPolicy, check_format
from ..quant.search import quantize
from ..quant.search_cache import SearchCache, calibration_key, search_key, stats_key
from .context import PassContext
from .quantize_experts import quantize_experts

_MATMUL_OPS = ("linear", "lora_linear", "logits")
_FLAGS = {"asym"}
_KEYS = {"group", "embed", "policy", "calib", "calib_max_bytes", "calib_ctx", "calib_tokens", "clip", "awq", "gptq",
         "asym"}


@dataclass
class TensorReport:
    """One row of the compile table: a weight, its format and storage."""

    name: str
    format: str
    shape: tuple[int, int]
    nbytes: int
    rule: str
    padded: tuple[int, int] | None = None
    fallback_from: str | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def as_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "format": self.format, "shape": list(self.shape), "nbytes": self.nbytes,
             "bpw": round(self.bits_per_weight, 4), "rule": self.rule}
        if self.padded:
            d["padded"] = list(self.padded)
        if self.fallback_from:
            d["fallback_from"] = self.fallback_from
        return d


@dataclass
class QuantReport:
    scheme: str
    tensors: list[TensorReport]
    awq: list[dict[str, Any]]
    calib_tokens: int = 0

    def by_format(self) -> list[dict[str, Any]]:
        """[{format, tensors, params, bytes, bpw}] summed per format."""
        rows: dict[str, dict[str, Any]] = {}
        for t in self.tensors:
            r = rows.setdefault(t.format, {"format": t.format, "tensors": 0, "params": 0, "bytes": 0})
            r["tensors"] += 1
            r["params"] += t.shape[0] * t.shape[1]
            r["bytes"] += t.nbytes
        for r in rows.values():
            r["bpw"] = round(8 * r["bytes"] / r["params"], 3)
        return list(rows.values())

    def as_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "calib_tokens": self.calib_tokens, "by_format": self.by_format(),
                "tensors": [t.as_dict() for t in self.tensors], "awq": self.awq}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantReport:
        """The report ``as_dict`` wrote (a manifest's ``quant``)."""
        tensors = [TensorReport(t["name"], t["format"], tuple(t["shape"]), t["nbytes"], t["rule"],
                                tuple(t["padded"]) if t.get("padded") else None, t.get("fallback_from"))
                   for t in d["tensors"]]
        return cls(d["scheme"], tensors, d["awq"], d["calib_tokens"])


class Quantize:
    name = "quantize"
    #: max |logits change| / max |logit| over a sentence of in-domain text on stories260K (a real
    #: trained model; random-init models are chaotic and amplify any rounding): int8 moves logits by
    #: 1.4%, fp8 by 4.8%, int4 by 28% (measured, then about doubled). Perplexity, KL divergence and
    #: top-1 agreement are in docs/quantization.md.
    TOLERANCE: ClassVar[dict[str, float]] = {"int8": 3e-2, "fp8": 0.1, "int4": 0.5}

    def __init__(self, *args: str):
        self.args = list(args)
        preset, opts = None, {}
        for a in args:
            key, sep, value = a.partition("=")
            key = key.strip().replace("-", "_")
            if not sep and key in PRESETS and preset is None:
                preset = key
            elif not sep and key in _FLAGS:
                opts[key] = "1"
            elif sep and key in _KEYS:
                opts[key] = value.strip()
            else:
                raise InfengError(f"quantize: bad argument {a!r}; expected a preset ({', '.join(PRESETS)}) or one of "
                                  f"{', '.join(sorted(_KEYS))} as key=value")
        self.group = _int(opts, "group")
        if self.group is not None and self.group not in GROUPS:
            raise InfengError(f"quantize: group must be one of {', '.join(map(str, GROUPS))}, got {self.group}")
        self.asym = _bool(opts, "asym", False)
        self.clip = _bool(opts, "clip", True)
        self.awq = _bool(opts, "awq", True)
        self.gptq = _bool(opts, "gptq", False)
        self.calib = opts.get("calib")
        self.calib_max_bytes = _int(opts, "calib_max_bytes")
        self.calib_ctx = _int(opts, "calib_ctx") or 256
        self.calib_tokens = _int(opts, "calib_tokens")
        if self.calib_tokens is not None and self.calib_tokens < 0:
            raise InfengError(f"quantize: calib_tokens must be >= 0 (0: all), got {self.calib_tokens}")
        policy_file = opts.get("policy")
        if preset is None and policy_file is None:
            raise InfengError("quantize: give a preset (int8, int4, fp8) or policy=FILE")
        self.policy = QuantPolicy.preset(preset, self.group, self.asym, opts.get("embed"),
                                         where=f"quantize({','.join(args)})") if preset else None
        if policy_file:
            self.policy = QuantPolicy.from_file(policy_file, self.policy)
            if opts.get("embed"):
                self.policy.embedding = check_format(opts["embed"], "quantize: embed")
        family = preset or _family(self.policy.default)
        self.tolerance = self.TOLERANCE.get(family, self.TOLERANCE["int4"])

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        # weights imported quantized (GGUF Q8_0/Q4_0) keep their codes: no second quantization
        kept = {name for name, w in graph.weights.items() if w.attrs.get("prequantized")}
        assignment = {name: a for name, a in self.policy.assign(graph).items() if name not in kept}
        if not assignment:
            return False
        stats = None
        awq_done = []
        quantized = {n: a.format for n, a in assignment.items() if is_quantized(a.format)}
        if self.calib:
            from ..quant.awq import apply_awq
            from ..quant.calibrate import calibration_ids

            if ctx.stage:
                ctx.stage(f"{self.name}: calibration")
            chunks = calibration_ids(ctx.calibration_tokenizer(graph, self.name), self.calib, self.calib_max_bytes,
                                     min(self.calib_ctx, int(graph.meta.get("max_position_embeddings") or self.calib_ctx)),
                                     self.calib_tokens)
            key = calibration_key(stats_key(print_graph(graph), [_stored(w) for w in graph.weights.values()], chunks),
                                  quantized, self.awq, self.gptq)
            stats, chosen = SearchCache(ctx.search_cache).get_or_calibrate(
                key, lambda: _calibrate(graph, chunks, quantized, self.awq, self.gptq, ctx.progress))
            if self.awq:
                awq_done = apply_awq(graph, stats, quantized, chosen=chosen)
            ctx.calib_tokens = int(chunks.size)
        grams = _grams(graph, stats, quantized) if stats else {}

        cache = SearchCache(ctx.search_cache if self.clip or self.gptq else None)

        def quantize_weight(name: str, fmt: str):
            w, gram = _source_f32(graph.weights[name]), grams.get(name)
            if self.gptq and gram is not None:
                from ..quant.gptq import gptq_quantize

                return cache.get_or_search(search_key(w, fmt, "gptq", gram),
                                           lambda: gptq_quantize(w, get_format(fmt), gram))
            return cache.get_or_search(search_key(w, fmt, "clip" if self.clip else "rtn", gram),
                                       lambda: quantize(w, get_format(fmt), search=self.clip, gram=gram,
                                                        symmetric_choice=clip_search))

        # one tensor per thread: each search is independent (numpy releases the GIL), results in order
        todo = [(name, a.format) for name, a in assignment.items() if is_quantized(a.format)]
        if ctx.stage:
            ctx.stage(f"{self.name}: search")
        quants = {}
        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            for (name, _), quant in zip(todo, pool.map(lambda job: quantize_weight(*job), todo)):
                quants[name] = quant
                if ctx.progress:
                    ctx.progress(len(quants), len(todo))
        reports = []
        for name, a in assignment.items():
            w = graph.weights[name]
            if is_quantized(a.format):
                w.quant = quants[name]
                nbytes = get_format(a.format).nbytes(tuple(w.type.shape))
            else:
                w.quant = None
                nbytes = w.type.numel() * {"f32": 4, "f16": 2, "bf16": 2}[a.format]
            w.attrs["format"] = a.format
            if a.fallback_from:
                w.attrs["fallback_from"] = a.fallback_from
            reports.append(TensorReport(name, a.format, tuple(w.type.shape), nbytes, a.rule, a.padded, a.fallback_from))
        for e in quantize_experts(graph, self.policy.default, search=self.clip):     # docs/moe.md
            reports.append(TensorReport(e.name, e.format, e.shape, e.nbytes, "experts (default)"))
        for name in sorted(kept & {w.name for n in graph.nodes for w in n.weights}):
            w = graph.weights[name]
            reports.append(TensorReport(name, w.format, tuple(w.type.shape), get_format(w.format).nbytes(w.type.shape),
                                        f"kept: {w.attrs['prequantized']}"))
        quantize_activations(graph)
        ctx.quant_report = QuantReport(f"quantize({','.join(self.args)})", reports,
                                       [{"value": s.value, "folded_into": s.folded_into, "alpha": s.alpha,
                                         "loss_before": s.loss_before, "loss_after": s.loss_after}
                                        for s in awq_done], ctx.calib_tokens if self.calib else 0)
        return True


def _int(opts: dict[str, str], key: str) -> int | None:
    if key not in opts:
        return None
    try:
        return int(opts[key])
    except ValueError:
        raise InfengError(f"quantize: {key} must be an integer, got {opts[key]!r}") from None


def _bool(opts: dict[str, str], key: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    if value.lower() in ("1", "true", "on", "yes"):
        return True
    if value.lower() in ("0", "false", "off", "no"):
        return False
    raise InfengError(f"quantize: {key} must be on or off, got {value!r}")


def _family(fmt: str) -> str:
    return "int4" if fmt.startswith("q4") else "int8" if fmt.startswith("q8") else "fp8" if fmt == "f8e4m3" else "int8"


def _stored(w) -> np.ndarray:
    """What ``w`` holds: its elements, or the codes of a weight a pass made quantized."""
    return w.quant.codes if w.array is None and w.file is None and w.quant is not None else w.raw()


def _source_f32(w) -> np.ndarray:
    """The weight's float32 values before any storage format (after AWQ scaling when it had one)."""
    from ..ir.types import bf16_to_f32

    raw = np.asarray(w.raw())
    return bf16_to_f32(raw) if w.type.dtype == "bf16" else raw.astype(np.float32)


def _weight_inputs(graph: Graph) -> dict[str, str]:
    """Per weight: the value every use of it multiplies, when all its uses are matmuls of one value."""
    inputs: dict[str, set[str | None]] = {}
    for n in graph.nodes:
        for i, w in enumerate(n.weights):
            key = n.inputs[0].name if (i == 0 and n.op in _MATMUL_OPS) else None
            inputs.setdefault(w.name, set()).add(key)
    return {name: next(iter(values)) for name, values in inputs.items() if len(values) == 1 and None not in values}


def _grams(graph: Graph, stats, formats: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Per weight: XᵀX / tokens of its input when every use of the weight reads the same value
    (statistics reduced to group blocks: the blocks of the weight's format in ``formats``)."""
    out = {}
    for name, value in _weight_inputs(graph).items():
        st = stats.get(value)
        if st is None:
            continue
        if st.gram is not None:
            out[name] = st.gram / max(st.tokens, 1)
        elif formats is not None and name in formats:
            out[name] = st.error_weights(get_format(formats[name]).group)
    return out


def _calibrate(graph: Graph, chunks: np.ndarray, formats: dict[str, str], awq: bool, full_grams: bool,
               progress) -> tuple[dict, dict]:
    """The statistics of every matmul input over ``chunks`` and, with ``awq``, the AWQ choices made on
    them: each value's scale is searched on its full Gram as soon as its layer's statistics are
    complete (the weights are not changed yet: the search reads none that an earlier fold
    changes), then only the group blocks the clipping search reads are kept (``full_grams``: the
    whole Gram, for GPTQ). ``apply_awq`` folds the choices afterwards."""
    from ..quant.awq import awq_site, search_alpha
    from ..quant.calibrate import collect

    groups: dict[str, set[int]] = {}
    for name, value in _weight_inputs(graph).items():
        if name in formats:
            groups.setdefault(value, set()).add(get_format(formats[name]).group)
    chosen: dict[str, tuple[float, float, float]] = {}

    def finish(value: str, st):
        if awq and awq_site(graph, value, formats):
            chosen[value] = search_alpha(graph, value, st, formats, symmetric_choice=clip_search)
        return st if full_grams else st.reduced(groups.get(value, set()))

    return collect(graph, chunks, progress=progress, finish=finish), chosen


def act_form(weight_format: str) -> tuple[int, int] | None:
    """(bits, block) of the activations an integer weight format multiplies; None for float/fp8."""
    if not is_quantized(weight_format) or get_format(weight_format).kind != "int":
        return None
    return (16, ACT_FORMS[16]) if get_format(weight_format).bits == 8 else (8, ACT_FORMS[8])


def quantize_activations(graph: Graph) -> None:
    """One ``quantize_act`` per (value, form) read by a matmul with an integer weight, placed
    before the first such reader; int8 weights get int16 activations, int4 weights int8 ones.
    Matmuls that already read a ``quantize_act`` are left alone (so it can run again)."""
    inserted: dict[tuple[str, tuple[int, int]], Node] = {}
    producers = {name: p.op for name, p in graph.producers().items()}
    for n in list(graph.nodes):
        if n.op not in _MATMUL_OPS or producers.get(n.inputs[0].name) == "quantize_act":
            continue
        form = act_form(n.weights[0].format)
        if form is None:
            continue
        x = n.inputs[0]
        key = (x.name, form)
        if key not in inserted:
            bits, block = form
            q = graph.add_node("quantize_act", [x], attrs={"bits": bits, "block": block},
                               out_names=[graph.fresh(f"{x.name}.q{bits}")])
            graph.nodes.pop()
            graph.nodes.insert(graph.nodes.index(n), q)
            inserted[key] = q
        n.inputs[0] = inserted[key].output


def quantize_entry(quant: str | None = None, policy: str | Path | None = None, calib: str | Path | None = None,
                   calib_max_bytes: int | None = None, calib_tokens: int | None = None) -> tuple[str, list[str]] | None:
    """The pipeline entry for ``--quant/--quant-policy/--calib/--calib-max-bytes/--calib-tokens`` (None:
    none given). The budget is written into the entry whenever there is calibration, so the manifest
    records it and a replay calibrates on the same chunks."""
    if quant is None and policy is None:
        if calib is not None:
            raise InfengError("--calib needs --quant (or --quant-policy): calibration chooses quantized scales")
        return None
    if calib_max_bytes is not None and calib is None:
        raise InfengError("--calib-max-bytes needs --calib FILE")
    args = [quant] if quant else []
    if policy is not None:
        args.append(f"policy={Path(policy).resolve()}")
    if calib is not None:
        args += calibration_args(calib, calib_max_bytes)
        if calib_tokens is not None:
            args.append(f"calib_tokens={calib_tokens}")
    Quantize(*args)                      # validates the arguments and the policy file now
    return ("quantize", args)


def quant_layout(w) -> dict[str, Any]:
    """Manifest fields of a quantized weight: the padded [N, K] of its packed layout, the format a
    fallback replaced, the activation form its kernel reads (empty for float weights)."""
    if not is_quantized(w.format):
        return {}
    out: dict[str, Any] = {}
    shape = tuple(w.type.shape)                 # stacked experts [E, N, K]: their [E*N, K] matrix
    pad = get_format(w.format).padding(shape if len(shape) == 2 else (int(np.prod(shape[:-1])), shape[-1]))
    if pad:
        out["padded"] = [pad["N"], pad["K"]]
    if w.attrs.get("fallback_from"):
        out["fallback_from"] = w.attrs["fallback_from"]
    form = act_form(w.format)
    if form:
        out["activations"] = {"bits": form[0], "block": form[1]}
    return out
