"""Which format each weight gets: a preset (``--quant int8|int4|fp8``), optionally refined by a
policy file (``--quant-policy FILE``) of per-tensor overrides.

Defaults: matrices read by ``linear`` get the preset's format; tables read by ``embedding`` or
``logits`` (the embeddings and the lm_head, one tensor when tied) stay at 8 bits or more (``q8r``;
``f8e4m3`` under fp8) unless the policy names another format for them; vectors (norm weights,
biases) stay float32. A matrix whose inner dimension K is not a multiple of its format's group
gets the ``fallback`` format, ``q8r`` by default (llama.cpp falls back to f16 for such tensors);
with ``"fallback": "pad"`` it is padded with zero columns to whole groups instead. The manifest
records either.

A policy file is JSON:

    {
      "preset": "int4",                      optional; else the --quant preset
      "group": 64, "asym": true,             optional; refine the preset's format
      "default": "q4g64a",                   optional; format of the linear weights
      "embedding": "q8r",                    optional; format of embedding / lm_head tables
      "fallback": "q8r",                     format for K % group != 0 (default q8r), or "pad"
      "tensors": {                           optional; glob on weight names -> format, first match wins
        "model.layers.0.*": "q8r",
        "*.mlp.down_proj.weight": "f16"
      }
    }

Formats: those of ``quant/formats.py`` plus ``f32``, ``f16``, ``bf16`` (kept as floats).
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from infeng_common.errors import InfengError

from ..ir import Graph
from .formats import FLOAT_FORMATS, QUANT_FORMATS, get_format, is_quantized

PRESETS = ("int8", "int4", "fp8")
GROUPS = (32, 64, 128)
_EMBEDDING_OPS = ("embedding", "logits")
_MATMUL_OPS = ("linear", "lora_linear", "logits")
_KEYS = {"preset", "group", "asym", "default", "embedding", "fallback", "tensors"}


class PolicyError(InfengError):
    """A quantization policy (preset arguments or policy file) that cannot be applied."""


def preset_format(preset: str, group: int | None = None, asym: bool = False, where: str = "--quant") -> str:
    """The linear-weight format of a preset: int4 -> q4g32, int8 -> q8r (q8gG with a group), fp8 -> f8e4m3."""
    if preset not in PRESETS:
        raise PolicyError(f"{where}: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if group is not None and group not in GROUPS:
        raise PolicyError(f"{where}: group must be one of {', '.join(map(str, GROUPS))}, got {group}")
    if preset == "fp8":
        if group is not None or asym:
            raise PolicyError(f"{where}: fp8 (f8e4m3) has one scale per row; it takes no group or asym")
        return "f8e4m3"
    if preset == "int8":
        if asym:
            raise PolicyError(f"{where}: int8 formats are symmetric; asym applies to int4")
        return "q8r" if group is None else f"q8g{group}"
    return f"q4g{group or 32}" + ("a" if asym else "")


def check_format(name: str, where: str) -> str:
    if name not in FLOAT_FORMATS and name not in QUANT_FORMATS:
        raise PolicyError(f"{where}: unknown format {name!r}; known: {', '.join(FLOAT_FORMATS + QUANT_FORMATS)}")
    return name


@dataclass
class Assignment:
    """The format chosen for one weight, and why."""

    format: str
    role: str                        # "linear" or "embedding"
    rule: str                        # "preset", "embedding default", or the policy pattern that matched
    padded: tuple[int, int] | None = None     # [Np, Kp] of the packed layout when it pads
    fallback_from: str | None = None          # the format that did not fit K (a fallback was used)


@dataclass
class QuantPolicy:
    default: str
    embedding: str
    tensors: list[tuple[str, str]] = field(default_factory=list)
    fallback: str | None = "q8r"              # format for K % group != 0; None: pad
    source: str = "--quant"

    @classmethod
    def preset(cls, preset: str, group: int | None = None, asym: bool = False, embedding: str | None = None,
               where: str = "--quant") -> QuantPolicy:
        default = preset_format(preset, group, asym, where)
        emb = check_format(embedding, where) if embedding else ("f8e4m3" if preset == "fp8" else "q8r")
        return cls(default, emb, source=where)

    @classmethod
    def from_file(cls, path: str | Path, base: QuantPolicy | None = None) -> QuantPolicy:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise PolicyError(f"{path}: policy file not found")
        try:
            spec = json.loads(path.read_text())
        except ValueError as e:
            raise PolicyError(f"{path}: malformed JSON: {e}") from None
        if not isinstance(spec, dict):
            raise PolicyError(f"{path}: a policy is a JSON object")
        unknown = set(spec) - _KEYS
        if unknown:
            raise PolicyError(f"{path}: unknown keys {sorted(unknown)}; a policy has {', '.join(sorted(_KEYS))}")
        preset, group, asym = spec.get("preset"), spec.get("group"), spec.get("asym", False)
        if group is not None and not isinstance(group, int):
            raise PolicyError(f"{path}: \"group\" must be an integer, got {group!r}")
        if not isinstance(asym, bool):
            raise PolicyError(f"{path}: \"asym\" must be true or false, got {asym!r}")
        if preset is not None or group is not None or asym:
            policy = cls.preset(preset or _preset_of(base, path), group, asym, where=where)
        elif base is not None:
            policy = cls(base.default, base.embedding, list(base.tensors), base.fallback, where)
        elif "default" in spec:
            policy = cls(check_format(str(spec["default"]), f"{path}: default"), "q8r", source=where)
        else:
            raise PolicyError(f"{path}: give \"preset\" or \"default\" (or pass --quant)")
        policy.source = where
        if "default" in spec:
            policy.default = check_format(str(spec["default"]), f"{path}: default")
        if "embedding" in spec:
            policy.embedding = check_format(str(spec["embedding"]), f"{path}: embedding")
        if "fallback" in spec:
            fallback = spec["fallback"]
            policy.fallback = None if fallback == "pad" else check_format(str(fallback), f"{path}: fallback")
        tensors = spec.get("tensors", {})
        if not isinstance(tensors, dict):
            raise PolicyError(f"{path}: \"tensors\" maps weight-name patterns to formats")
        policy.tensors = [(str(p), check_format(str(f), f"{path}: tensors[{p!r}]")) for p, f in tensors.items()]
        return policy

    def assign(self, graph: Graph) -> dict[str, Assignment]:
        """The format of every matrix the policy covers, by weight name."""
        roles: dict[str, str] = {}
        for n in graph.nodes:
            for i, w in enumerate(n.weights):
                if i != 0 or w.type.rank != 2 or n.op not in _MATMUL_OPS + _EMBEDDING_OPS:
                    continue
                role = "embedding" if n.op in _EMBEDDING_OPS else "linear"
                if roles.get(w.name) != "embedding":
                    roles[w.name] = role
        matched = {p: False for p, _ in self.tensors}
        out: dict[str, Assignment] = {}
        for name, role in roles.items():
            fmt, rule = (self.embedding, "embedding default") if role == "embedding" else (self.default, "default")
            for pattern, pfmt in self.tensors:
                if fnmatch.fnmatchcase(name, pattern):
                    fmt, rule, matched[pattern] = pfmt, pattern, True
                    break
            out[name] = self._fit(name, graph.weights[name].type.shape, fmt, role, rule)
        unused = [p for p, hit in matched.items() if not hit]
        if unused:
            raise PolicyError(f"{self.source}: tensor pattern {unused[0]!r} matches no quantizable weight "
                              f"(e.g. {next(iter(roles), 'none')})")
        return out

    def _fit(self, name: str, shape: tuple[int, ...], fmt: str, role: str, rule: str) -> Assignment:
        if not is_quantized(fmt):
            return Assignment(fmt, role, rule)
        q = get_format(fmt)
        N, K = shape
        if q.kind == "int" and q.group and K % q.group and self.fallback is not None:
            fb = self.fallback
            if is_quantized(fb):
                g = get_format(fb)
                if g.kind == "int" and g.group and K % g.group:
                    raise PolicyError(f"{self.source}: fallback {fb} for @{name} [{N}, {K}] does not fit K either; "
                                      "use a per-row format (q8r, f8e4m3), a float format, or \"pad\"")
                pad = g.padding((N, K))
                return Assignment(fb, role, rule, tuple(pad.values()) if pad else None, fmt)
            return Assignment(fb, role, rule, None, fmt)
        pad = q.padding((N, K))
        return Assignment(fmt, role, rule, tuple(pad.values()) if pad else None)


def _preset_of(base: QuantPolicy | None, path: Path) -> str:
    if base is None:
        raise PolicyError(f"{path}: \"group\"/\"asym\" refine a preset; give \"preset\" (or pass --quant)")
    fmt = base.default
    if fmt.startswith("q4"):
        return "int4"
    if fmt.startswith("q8"):
        return "int8"
    if fmt == "f8e4m3":
        return "fp8"
    raise PolicyError(f"{path}: \"group\"/\"asym\" refine a preset, but the base format is {fmt}")
