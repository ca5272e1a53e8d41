"""Hugging Face frontend: config.json + safetensors -> IR graph, weights left memory-mapped.

Families: llama (incl. Llama-3 rope scaling, explicit head_dim, tied embeddings), mistral
(sliding window honoured), qwen2 (q/k/v bias, per-layer sliding window), gpt2 (LayerNorm, learned
positions, Conv1D weights stored transposed, gelu_new), and the mixture-of-experts families
mixtral, qwen2_moe (shared expert), qwen3_moe (per-head q/k norm), olmoe (q/k norm) and gpt_oss
(attention sinks, YaRN, alternating sliding-window layers, clamped SwiGLU experts with biases):
docs/moe.md.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from infeng_common.errors import ModelFormatError, UnsupportedError
from infeng_common.jsonfile import read_json_object

from ..ir import Graph, TensorType, Value, Weight
from ..ir.moe_ops import StackedWeight, TensorPart
from ..ir.ops import rope_attention_factor
from .checkpoint import TensorEntry, read_checkpoint
from .mxfp4 import mxfp4_weight

#: Mixture-of-experts families (built by ``build_llama`` with a routed MLP, docs/moe.md).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
LLAMA_LIKE = ("llama", "mistral", "qwen2") + MOE_FAMILIES
FAMILIES = LLAMA_LIKE + ("gpt2",)
_TORCH_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory, or a ``model.safetensors`` path with ``config.json`` beside it."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file or directory")
    model_dir = p.parent if p.is_file() else p
    if p.is_file() and p.suffix != ".safetensors":
        raise ModelFormatError(f"{p}: expected a model directory or a .safetensors file")
    if not (model_dir / "config.json").is_file():
        raise ModelFormatError(f"{model_dir / 'config.json'}: file not found (a Hugging Face checkpoint needs it)")
    return model_dir


def load_config(model_dir: Path) -> dict[str, Any]:
    return read_json_object(model_dir / "config.json")


def import_hf(path: str | Path) -> Graph:
    """Import a checkpoint as an IR graph with inputs ``%tokens``, ``%positions`` and output ``%logits``."""
    model_dir = resolve_model_dir(path)
    config = load_config(model_dir)
    family = config.get("model_type")
    if family not in FAMILIES:
        arch = (config.get("architectures") or ["?"])[0]
        raise UnsupportedError(f"{model_dir / 'config.json'}: unknown architecture model_type={family!r} ({arch}); "
                               f"supported: {', '.join(FAMILIES)}")
    tensors = read_checkpoint(model_dir)
    builder = _Builder(model_dir, config, tensors)
    try:
        return builder.build_gpt2() if family == "gpt2" else builder.build_llama()
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
        # a value of the wrong JSON type or shape that no check above names: still one line
        raise ModelFormatError(f"{model_dir / 'config.json'}: a malformed value ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None


class _Builder:
    def __init__(self, model_dir: Path, config: dict[str, Any], tensors: dict[str, TensorEntry]):
        self.dir, self.config, self.tensors = model_dir, config, tensors
        self.cfg_path = model_dir / "config.json"
        index = model_dir / "model.safetensors.index.json"
        self.source = index if index.is_file() else model_dir / "model.safetensors"
        dtype = config.get("torch_dtype") or config.get("dtype")
        self.expected_dtype = _TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None

    def need(self, *keys: str) -> Any:
        """Required positive integer fields."""
        out = []
        for k in keys:
            if self.config.get(k) is None:
                raise ModelFormatError(f"{self.cfg_path}: missing required field {k!r}")
            out.append(self.optional(k, None))
        return out if len(out) > 1 else out[0]

    def optional(self, key: str, default: Any, kind: type = int) -> Any:
        """An optional positive field of type ``kind``; ``default`` when absent or null."""
        v = self.config.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 \
                or (kind is int and v != int(v)):
            what = "a positive integer" if kind is int else "a positive number"
            raise ModelFormatError(f"{self.cfg_path}: field {key!r} must be {what}, got {v!r}")
        return kind(v)

    def check_layers(self, layers: int, key: str) -> None:
        """``layers`` no more than the checkpoint has tensors for (before anything is built per layer)."""
        indices = {int(m.group(1)) for name in self.tensors if (m := re.search(r"(?:^|\.)(?:layers|h)\.(\d+)\.", name))}
        if layers > len(indices):
            raise ModelFormatError(f"{self.cfg_path}: {key}={layers}, but the checkpoint holds tensors for "
                                   f"{len(indices)} layers")

    def entry(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        """The checkpoint's tensor ``name``, stored with ``shape`` (one line naming it otherwise)."""
        entry = self.tensors.get(name)
        if entry is None:
            raise ModelFormatError(f"{self.source}: tensor {name} is missing from the checkpoint")
        if entry.shape != shape:
            raise ModelFormatError(f"{entry.file}: tensor {name} has shape {list(entry.shape)} but config.json "
                                   f"implies {list(shape)}")
        return entry

    def weight(self, g: Graph, name: str, shape: tuple[int, ...], transposed: bool = False) -> Weight:
        if name in g.weights:
            return g.weights[name]
        entry = self.entry(name, tuple(reversed(shape)) if transposed else shape)
        if self.expected_dtype and entry.dtype != self.expected_dtype:
            raise ModelFormatError(f"{entry.file}: tensor {name} is {entry.dtype} but config.json says "
                                   f"dtype {self.expected_dtype}")
        return g.add_weight(Weight(name, TensorType(entry.dtype, shape), entry.file, entry.offset, transposed))

    def graph(self, meta: dict[str, Any]) -> tuple[Graph, Value, Value]:
        g = Graph(self.config.get("_name_or_path", "").split("/")[-1] or self.dir.name, meta)
        g.name = "".join(c if c.isalnum() or c in "_.-" else "_" for c in g.name) or "model"
        tokens = g.add_input("tokens", TensorType("i32", ("T",)))
        positions = g.add_input("positions", TensorType("i32", ("T",)))
        return g, tokens, positions

    def common_meta(self, family: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                    vocab: int, max_pos: int) -> dict[str, Any]:
        eos = self.config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        bos = self.config.get("bos_token_id")
        for key, value in [("bos_token_id", bos)] + [("eos_token_id", e) for e in eos_ids]:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
                raise ModelFormatError(f"{self.dir / 'config.json'}: {key} must be a token id in [0, {vocab}), "
                                       f"got {value!r}")
        return {"family": family, "model_dir": str(self.dir.resolve()), "hidden_size": hidden,
                "num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
                "vocab_size": vocab, "max_position_embeddings": max_pos, "bos_token_id": bos, "eos_token_ids": eos_ids}

    # -- llama / mistral / qwen2 ---------------------------------------------------------
    def build_llama(self) -> Graph:
        c = self.config
        family = c["model_type"]
        hidden, layers, heads, inter, vocab = self.need(
            "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        self.check_layers(layers, "num_hidden_layers")
        kv_heads = self.optional("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelFormatError(f"{self.cfg_path}: num_attention_heads={heads} is not a multiple of "
                                   f"num_key_value_heads={kv_heads}")
        head_dim = self.optional("head_dim", hidden // heads)
        eps = self.optional("rms_norm_eps", 1e-6, float)
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"{self.cfg_path}: hidden_act={act!r} is not supported for {family} (silu only)")
        rope = self.rope_attrs(heads, head_dim)
        qkv_bias = (family == "qwen2" or bool(c.get("attention_bias"))
                    or (family == "qwen2_moe" and c.get("qkv_bias", True)))
        o_bias = family not in ("qwen2", "qwen2_moe") and bool(c.get("attention_bias"))
        if c.get("clip_qkv") is not None:
            raise UnsupportedError(f"{self.cfg_path}: clip_qkv is not supported")
        mlp_bias = bool(c.get("mlp_bias"))
        windows = self.sliding_windows(family, layers)
        max_pos = self.optional("max_position_embeddings", 2048)
        g, tokens, positions = self.graph(self.common_meta(family, hidden, layers, heads, kv_heads, head_dim,
                                                            vocab, max_pos))
        embed = self.weight(g, "model.embed_tokens.weight", (vocab, hidden))
        h = g.add_node("embedding", [tokens], [embed], name="embed").output
        for i in range(layers):
            p = f"model.layers.{i}."
            W = lambda n, shape, p=p: self.weight(g, p + n, shape)
            x = g.add_node("rms_norm", [h], [W("input_layernorm.weight", (hidden,))], {"eps": eps},
                           name=f"l{i}.attn_norm").output

            def proj(n: str, out: int, inp: int, bias: bool, value_name: str, x=x, W=W) -> Value:
                ws = [W(f"{n}.weight", (out, inp))] + ([W(f"{n}.bias", (out,))] if bias else [])
                return g.add_node("linear", [x], ws, name=value_name).output

            q = proj("self_attn.q_proj", heads * head_dim, hidden, qkv_bias, f"l{i}.q")
            k = proj("self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias, f"l{i}.k")
            v = proj("self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias, f"l{i}.v")
            q, k = self.qk_norm(g, W, i, q, k, heads, kv_heads, head_dim, eps)
            q = g.add_node("rope", [q, positions], attrs={"n_heads": heads, **rope}, name=f"l{i}.q_rot").output
            k = g.add_node("rope", [k, positions], attrs={"n_heads": kv_heads, **rope}, name=f"l{i}.k_rot").output
            # YaRN scales cos and sin, so q and k, by one factor: the scores by its square
            attn_attrs = {"layer": i, "n_heads": heads, "n_kv_heads": kv_heads, "head_dim": head_dim,
                          "scale": rope_attention_factor(rope) ** 2 / math.sqrt(head_dim)}
            if windows[i]:
                attn_attrs["window"] = windows[i]
            sinks = []
            if family == "gpt_oss":
                attn_attrs["sinks"] = True
                sinks = [W("self_attn.sinks", (heads,))]
            a = g.add_node("attention", [q, k, v, positions], sinks, attrs=attn_attrs, name=f"l{i}.attn").output
            ws = [W("self_attn.o_proj.weight", (hidden, heads * head_dim))]
            ws += [W("self_attn.o_proj.bias", (hidden,))] if o_bias else []
            o = g.add_node("linear", [a], ws, name=f"l{i}.o").output
            h = g.add_node("add", [h, o], name=f"l{i}.h_attn").output
            x = g.add_node("rms_norm", [h], [W("post_attention_layernorm.weight", (hidden,))], {"eps": eps},
                           name=f"l{i}.mlp_norm").output
            if family in MOE_FAMILIES and self.sparse_layer(i):
                down = self.moe_block(g, p, i, x, hidden)
            else:
                down = self.dense_mlp(g, p, "mlp", f"l{i}", x, hidden, inter, mlp_bias)
            h = g.add_node("add", [h, down], name=f"l{i}.out").output
        x = g.add_node("rms_norm", [h], [self.weight(g, "model.norm.weight", (hidden,))], {"eps": eps},
                       name="final_norm").output
        head = self.output_embedding(g, "model.embed_tokens.weight", vocab, hidden)
        g.outputs = [g.add_node("logits", [x], [head], name="logits").output]
        return g

    def dense_mlp(self, g: Graph, prefix: str, module: str, name: str, x: Value, hidden: int, inter: int,
                  bias: bool) -> Value:
        """down(silu(gate(x)) * up(x)) of the module ``prefix + module`` (a llama MLP or a shared expert)."""
        def proj(n: str, out: int, inp: int, value_name: str, source: Value) -> Value:
            p = f"{prefix}{module}.{n}"
            ws = [self.weight(g, p + ".weight", (out, inp))] + ([self.weight(g, p + ".bias", (out,))] if bias else [])
            return g.add_node("linear", [source], ws, name=value_name).output

        gate = proj("gate_proj", inter, hidden, f"{name}.gate", x)
        up = proj("up_proj", inter, hidden, f"{name}.up", x)
        act = g.add_node("silu_mul", [gate, up], name=f"{name}.act").output
        return proj("down_proj", hidden, inter, f"{name}.down", act)

    def qk_norm(self, g: Graph, W, i: int, q: Value, k: Value, heads: int, kv_heads: int, head_dim: int,
                eps: float) -> tuple[Value, Value]:
        """Qwen3-MoE's RMS norm of each head of q and k, OLMoE's of the whole q and k rows."""
        family = self.config["model_type"]
        if family == "qwen3_moe":
            return tuple(g.add_node("head_rms_norm", [x], [W(f"self_attn.{n}.weight", (head_dim,))],
                                    {"eps": eps, "head_dim": head_dim}, name=f"l{i}.{n}").output
                         for x, n in ((q, "q_norm"), (k, "k_norm")))
        if family == "olmoe":
            return tuple(g.add_node("rms_norm", [x], [W(f"self_attn.{n}.weight", (width,))], {"eps": eps},
                                    name=f"l{i}.{n}").output
                         for x, n, width in ((q, "q_norm", heads * head_dim), (k, "k_norm", kv_heads * head_dim)))
        return q, k

    def sparse_layer(self, i: int) -> bool:
        """Whether layer ``i`` routes its MLP through experts (Qwen-MoE: not in mlp_only_layers, and
        every decoder_sparse_step-th layer)."""
        c = self.config
        if c["model_type"] not in ("qwen2_moe", "qwen3_moe"):
            return True
        only = c.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ModelFormatError(f"{self.cfg_path}: mlp_only_layers must be a list of layer indices")
        step = self.optional("decoder_sparse_step", 1)
        return i not in only and (i + 1) % step == 0

    def moe_block(self, g: Graph, prefix: str, i: int, x: Value, hidden: int) -> Value:
        """router -> experts (+ the sigmoid-gated shared expert of Qwen2-MoE) of layer ``i``."""
        c = self.config
        family = c["model_type"]
        n_experts = self.need("num_local_experts" if c.get("num_local_experts") is not None else "num_experts")
        top_k = self.need("num_experts_per_tok")
        if top_k > n_experts:
            raise ModelFormatError(f"{self.cfg_path}: num_experts_per_tok={top_k} exceeds the {n_experts} experts")
        inter = self.need("moe_intermediate_size" if family in ("qwen2_moe", "qwen3_moe") else "intermediate_size")
        experts_attrs: dict[str, Any] = {"activation": "silu", "gate_up": "concat"}
        if family == "gpt_oss":
            router_w = [self.weight(g, prefix + "mlp.router.weight", (n_experts, hidden)),
                        self.weight(g, prefix + "mlp.router.bias", (n_experts,))]
            router_attrs = {"top_k": top_k, "scoring": "topk_softmax", "renormalize": False}
            alpha, limit = c.get("swiglu_alpha", 1.702), c.get("swiglu_limit", 7.0)
            for key, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ModelFormatError(f"{self.cfg_path}: {key} must be a number, got {value!r}")
            experts_attrs = {"activation": "swiglu_clamp", "gate_up": "interleaved", "alpha": float(alpha),
                             "limit": float(limit)}
            expert_ws = self.gpt_oss_experts(g, prefix + "mlp.experts.", n_experts, hidden, inter)
        else:
            gate = "block_sparse_moe.gate" if family == "mixtral" else "mlp.gate"
            router_w = [self.weight(g, f"{prefix}{gate}.weight", (n_experts, hidden))]
            renormalize = family == "mixtral" or bool(c.get("norm_topk_prob"))
            router_attrs = {"top_k": top_k, "scoring": "softmax", "renormalize": renormalize}
            names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            experts = f"{prefix}block_sparse_moe.experts." if family == "mixtral" else f"{prefix}mlp.experts."
            expert_ws = self.stacked_experts(g, experts, names, n_experts, hidden, inter)
        weights, ids = g.add_node("router", [x], router_w, router_attrs,
                                  out_names=[f"l{i}.route_weights", f"l{i}.route_ids"]).outputs
        out = g.add_node("experts", [x, weights, ids], expert_ws, experts_attrs, name=f"l{i}.experts").output
        if family == "qwen2_moe" and self.optional("shared_expert_intermediate_size", 0):
            shared_inter = self.need("shared_expert_intermediate_size")
            shared = self.dense_mlp(g, prefix, "mlp.shared_expert", f"l{i}.shared", x, hidden, shared_inter, False)
            gate_w = self.weight(g, prefix + "mlp.shared_expert_gate.weight", (1, hidden))
            shared = g.add_node("sigmoid_gate", [shared, x], [gate_w], name=f"l{i}.shared.gated").output
            out = g.add_node("add", [out, shared], name=f"l{i}.moe").output
        return out

    def stacked_experts(self, g: Graph, prefix: str, names: tuple[str, str, str], n_experts: int, hidden: int,
                        inter: int) -> list[Weight]:
        """gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I] stacked from
        one tensor per expert and projection (``prefix{e}.{name}.weight``)."""
        gate, up, down = names
        gate_up = [self.entry(f"{prefix}{e}.{n}.weight", (inter, hidden)) for e in range(n_experts) for n in (gate, up)]
        downs = [self.entry(f"{prefix}{e}.{down}.weight", (hidden, inter)) for e in range(n_experts)]
        return [self.stacked(g, f"{prefix}gate_up", gate_up, (n_experts, 2 * inter, hidden)),
                self.stacked(g, f"{prefix}down", downs, (n_experts, hidden, inter))]

    def stacked(self, g: Graph, name: str, entries: list[TensorEntry], shape: tuple[int, ...],
                swap_last: bool = False) -> Weight:
        dtypes = {t.dtype for t in entries}
        if len(dtypes) != 1 or (self.expected_dtype and dtypes != {self.expected_dtype}):
            raise ModelFormatError(f"{entries[0].file}: the tensors of {name} are {sorted(dtypes)} but config.json "
                                   f"says dtype {self.expected_dtype}")
        parts = tuple(TensorPart(t.file, t.offset, tuple(t.shape)) for t in entries)
        return g.add_weight(StackedWeight(name, TensorType(entries[0].dtype, shape), parts=parts, swap_last=swap_last))

    def gpt_oss_experts(self, g: Graph, prefix: str, n_experts: int, hidden: int, inter: int) -> list[Weight]:
        """GPT-OSS's fused expert tensors: gate_up_proj [E, H, 2I] (gate and up columns interleaved) and
        down_proj [E, I, H], stored [in, out], read as [E, out, in]; or, as openai/gpt-oss ships them,
        MXFP4 ``*_blocks`` / ``*_scales`` (already [E, out, in/32, ...]), kept as stored; their biases
        [E, 2I], [E, H]."""
        if prefix + "gate_up_proj_blocks" in self.tensors:          # MXFP4, as openai/gpt-oss ships them
            matrices = [self.mxfp4(g, prefix + "gate_up_proj", (n_experts, 2 * inter, hidden)),
                        self.mxfp4(g, prefix + "down_proj", (n_experts, hidden, inter))]
        else:
            gate_up = self.entry(prefix + "gate_up_proj", (n_experts, hidden, 2 * inter))
            down = self.entry(prefix + "down_proj", (n_experts, inter, hidden))
            matrices = [self.stacked(g, prefix + "gate_up_proj", [gate_up], (n_experts, 2 * inter, hidden),
                                     swap_last=True),
                        self.stacked(g, prefix + "down_proj", [down], (n_experts, hidden, inter), swap_last=True)]
        return [*matrices, self.weight(g, prefix + "gate_up_proj_bias", (n_experts, 2 * inter)),
                self.weight(g, prefix + "down_proj_bias", (n_experts, hidden))]

    def mxfp4(self, g: Graph, name: str, shape: tuple[int, ...]) -> Weight:
        """The MXFP4 weight ``name`` [E, out, in] from its ``_blocks`` and ``_scales`` tensors, kept as stored."""
        blocks, scales = self.tensors.get(name + "_blocks"), self.tensors.get(name + "_scales")
        if blocks is None or scales is None:
            raise ModelFormatError(f"{self.source}: tensor {name}_{'scales' if blocks else 'blocks'} is missing "
                                   "from the checkpoint")
        weight = mxfp4_weight(name, blocks, scales)
        if tuple(weight.type.shape) != shape:
            raise ModelFormatError(f"{blocks.file}: MXFP4 tensor {name} is {list(weight.type.shape)} but config.json "
                                   f"implies {list(shape)}")
        return g.add_weight(weight)

    def output_embedding(self, g: Graph, embed_name: str, vocab: int, hidden: int) -> Weight:
        tied = self.config.get("tie_word_embeddings", self.config["model_type"] == "gpt2")
        if tied or ("lm_head.weight" not in self.tensors and self.config["model_type"] == "gpt2"):
            return g.weights[embed_name]
        return self.weight(g, "lm_head.weight", (vocab, hidden))

    def rope_attrs(self, heads: int, head_dim: int) -> dict[str, Any]:
        c = self.config
        params = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or None
        for key, value in (("rope_parameters", params), ("rope_scaling", scaling or {})):
            if not isinstance(value, dict):
                raise ModelFormatError(f"{self.cfg_path}: {key} must be an object, got {type(value).__name__}")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = {**(scaling or {}), **params}.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ModelFormatError(f"{self.cfg_path}: rope scaling {key} must be a positive number, got {value!r}")
        theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ModelFormatError(f"{self.cfg_path}: rope_theta must be a positive number, got {theta!r}")
        kind = (params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default")
        if params and kind != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise UnsupportedError(f"{self.cfg_path}: rope scaling type {kind!r} is not supported "
                                   "(supported: default, linear, llama3, yarn)")
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedError(f"{self.cfg_path}: partial_rotary_factor is not supported")
        attrs: dict[str, Any] = {"head_dim": head_dim, "theta": float(theta)}
        if kind != "default":
            attrs["scaling"] = {"rope_type": kind,
                                **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}
        return attrs

    def sliding_windows(self, family: str, layers: int) -> list[int | None]:
        c = self.config
        window = None if c.get("sliding_window") == 0 else self.optional("sliding_window", None)   # Qwen2-MoE writes 0
        if family in ("mistral", "mixtral", "qwen3_moe"):
            return [window or None] * layers
        if family == "gpt_oss":
            types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(layers)]
            if not isinstance(types, list) or len(types) < layers:
                raise ModelFormatError(f"{self.cfg_path}: layer_types must list the {layers} layers")
            return [window if t == "sliding_attention" else None for t in types[:layers]]
        if family in ("qwen2", "qwen2_moe") and c.get("use_sliding_window") and window:
            types = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", layers)
                                             else "full_attention" for i in range(layers)]
            return [window if t == "sliding_attention" else None for t in types]
        return [None] * layers

    # -- gpt2 -----------------------------------------------------------------------------
    def build_gpt2(self) -> Graph:
        c = self.config
        hidden, layers, heads, vocab, n_pos = self.need("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
        self.check_layers(layers, "n_layer")
        inter = self.optional("n_inner", 4 * hidden)
        if hidden % heads:
            raise ModelFormatError(f"{self.cfg_path}: n_embd={hidden} is not a multiple of n_head={heads}")
        head_dim = hidden // heads
        eps = self.optional("layer_norm_epsilon", 1e-5, float)
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise UnsupportedError(f"{self.cfg_path}: activation_function={act!r} is not supported")
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("reorder_and_upcast_attn"):
            raise UnsupportedError(f"{self.cfg_path}: scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn "
                                   "are not supported")
        prefix = "transformer." if "transformer.wte.weight" in self.tensors else ""
        g, tokens, positions = self.graph(self.common_meta("gpt2", hidden, layers, heads, heads, head_dim,
                                                            vocab, n_pos))
        W = lambda n, shape, t=False: self.weight(g, prefix + n, shape, transposed=t)
        wte = W("wte.weight", (vocab, hidden))
        tok = g.add_node("embedding", [tokens], [wte], name="embed").output
        pos = g.add_node("embedding", [positions], [W("wpe.weight", (n_pos, hidden))], name="pos_embed").output
        h = g.add_node("add", [tok, pos], name="h0").output
        scale = 1.0 / math.sqrt(head_dim) if c.get("scale_attn_weights", True) else 1.0
        gelu = {"approximate": "none" if act == "gelu" else "tanh"}

        def ln(x: Value, n: str, value_name: str) -> Value:
            return g.add_node("layer_norm", [x], [W(f"{n}.weight", (hidden,)), W(f"{n}.bias", (hidden,))],
                              {"eps": eps}, name=value_name).output

        def conv1d(x: Value, n: str, out: int, inp: int, value_name: str) -> Value:
            return g.add_node("linear", [x], [W(f"{n}.weight", (out, inp), True), W(f"{n}.bias", (out,))],
                              name=value_name).output

        for i in range(layers):
            p = f"h.{i}."
            x = ln(h, p + "ln_1", f"l{i}.attn_norm")
            qkv = conv1d(x, p + "attn.c_attn", 3 * hidden, hidden, f"l{i}.qkv")
            q, k, v = g.add_node("split", [qkv], attrs={"sizes": [hidden] * 3},
                                 out_names=[f"l{i}.q", f"l{i}.k", f"l{i}.v"]).outputs
            a = g.add_node("attention", [q, k, v, positions], name=f"l{i}.attn",
                           attrs={"layer": i, "n_heads": heads, "n_kv_heads": heads, "head_dim": head_dim,
                                  "scale": scale}).output
            o = conv1d(a, p + "attn.c_proj", hidden, hidden, f"l{i}.o")
            h = g.add_node("add", [h, o], name=f"l{i}.h_attn").output
            x = ln(h, p + "ln_2", f"l{i}.mlp_norm")
            up = conv1d(x, p + "mlp.c_fc", inter, hidden, f"l{i}.up")
            act_v = g.add_node("gelu", [up], attrs=gelu, name=f"l{i}.act").output
            down = conv1d(act_v, p + "mlp.c_proj", hidden, inter, f"l{i}.down")
            h = g.add_node("add", [h, down], name=f"l{i}.out").output
        x = ln(h, "ln_f", "final_norm")
        head = self.output_embedding(g, prefix + "wte.weight", vocab, hidden)
        g.outputs = [g.add_node("logits", [x], [head], name="logits").output]
        return g
