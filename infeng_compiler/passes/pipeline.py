"""``build_pipeline(options)``: the compile pipeline the options ask for, as named phases, built in
this one place (docs/ir.md "Phases"):

    model    merge-lora(NAME)... lora-slots(K,R[,TARGETS])
    storage  [fht-kv] kv-format(...)  cast-weights(DTYPE[,...])  [quantize(...)]  [act-precision(...)]
    fusion   fuse-linears
    memory   plan-memory

The import phase (the ONNX frontend's raising passes) runs inside the import; ``--passes`` gives
the whole compile pipeline instead, its entries falling into phases by the pass table, and ends
with the memory phase (``plan-memory`` is added when it does not name it: lowering reads the plan).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infeng_common.errors import InfengError

from ..ir import Graph
from .act_precision import DEFAULT_ACT_PRECISION, act_precision_entry
from .kv_cache import kv_entries
from .manager import Entry, Phase, parse_pipeline, phases_of
from .quantize import quantize_entry

if TYPE_CHECKING:
    from ..compile import CompileOptions

#: The compile phases build_pipeline returns, in order (the import phase is the frontend's).
COMPILE_PHASES = ("model", "storage", "fusion", "memory")
#: The memory phase's one entry, which every compile pipeline ends with.
MEMORY_PLAN: Entry = ("plan-memory", [])


def build_pipeline(options: CompileOptions, adapters: dict[str, Any] | None = None,
                   graph: Graph | None = None) -> list[Phase]:
    """The phases of the compile pipeline ``options`` ask for (over ``graph``, the imported model,
    when given: an explicit dtype widens the quantized weights a GGUF import kept exact), every
    phase of ``COMPILE_PHASES`` present, empty or not."""
    if options.passes:
        given = [flag for flag, value in (("--quant", options.quant), ("--quant-policy", options.quant_policy),
                                          ("--kv", options.kv != "f32"), ("--dtype", options.dtype),
                                          ("--merge", options.merge), ("--calib", options.calib),
                                          ("--act-precision", options.act_precision)) if value]
        if given:
            raise InfengError(f"--passes is the whole pipeline; {', '.join(given)} would be ignored: put "
                              f"those passes in --passes instead")
        return phases_of(_with_memory_plan(parse_pipeline(options.passes)))
    phases = {name: Phase(name, []) for name in COMPILE_PHASES}
    phases["model"].entries += _lora_entries(options, adapters or {})
    phases["storage"].entries += _storage_entries(options, graph)
    phases["fusion"].entries.append(("fuse-linears", []))
    phases["memory"].entries.append(MEMORY_PLAN)
    return list(phases.values())


def _with_memory_plan(entries: list[Entry]) -> list[Entry]:
    """An explicit pipeline ending with the memory plan: added when missing, refused before a pass
    that would change the graph it planned."""
    planned = [i for i, (name, _) in enumerate(entries) if name == MEMORY_PLAN[0]]
    if not planned:
        return entries + [MEMORY_PLAN]
    if planned[0] != len(entries) - 1:
        raise InfengError(f"--passes: plan-memory plans the final graph; put it last (after "
                          f"{entries[planned[0] + 1][0]}) or leave it out (it is added at the end)")
    return entries


def _lora_entries(options: CompileOptions, adapters: dict[str, Any]) -> list[Entry]:
    entries: list[Entry] = [("merge-lora", [name]) for name in options.merge]
    slotted = [a for name, a in adapters.items() if name not in options.merge]
    if options.max_adapters or slotted:
        k = options.max_adapters or max(4, len(slotted))
        r = options.max_rank or max([a.max_rank for a in slotted] + [16])
        entries.append(("lora-slots", [str(k), str(r)] + ([options.lora_targets] if options.lora_targets else [])))
    return entries


def _storage_entries(options: CompileOptions, graph: Graph | None) -> list[Entry]:
    imported_quantized = graph is not None and any(w.attrs.get("prequantized") for w in graph.weights.values())
    kv = kv_entries(options.kv, options.kv_window, options.calib, options.calib_max_bytes)
    weights_calibrated = options.quant is not None or options.quant_policy is not None
    kv_calibrated = any(a.startswith("calib=") for _, args in kv for a in args)
    if options.calib is not None and not weights_calibrated and not kv_calibrated:
        raise InfengError("--calib needs --quant (calibrated weight scales) or an int8/int4 --kv (K centring)")
    quantize = quantize_entry(options.quant, options.quant_policy,
                              *((options.calib, options.calib_max_bytes) if weights_calibrated else (None, None)),
                              calib_tokens=options.calib_tokens)
    cast = [options.dtype or "f32"] + (["all" if options.dtype else "keep-quantized"] if imported_quantized else [])
    integer_weights = quantize is not None or (imported_quantized and not options.dtype)
    act = act_precision_entry(options.act_precision or DEFAULT_ACT_PRECISION) if integer_weights else None
    return kv + [("cast-weights", cast)] + ([quantize] if quantize else []) + ([act] if act else [])
