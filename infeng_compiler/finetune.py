"""Supervised fine-tuning of a LoRA adapter (``infeng finetune``), on transformers + PEFT.

Data is JSONL, one example per line, either chat ``{"messages": [{"role", "content"}, ...]}`` or
``{"prompt": ..., "completion": ...}`` (a user turn and the assistant's answer). Examples are
rendered with the model's chat template (a model without one gets ``prompt + completion`` as plain
text) and the loss covers the answer tokens only: every assistant turn, its end-of-turn token
included, so that the adapter learns where to stop.

The model is an HF directory, a hub id or a GGUF file (transformers dequantizes it to f32). Training
runs in f32 with bf16 autocast where the CPU has bf16 instructions; the adapter is saved in f32 as
a standard PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) that PEFT,
``infeng compile --lora``, ``infeng serve --adapter`` and the runtime's hot-load take as it is.
Checkpoints (adapter, optimizer, scheduler, RNG) go to ``ADAPTER_DIR/checkpoints`` and
``resume=True`` continues from the latest one.
"""
from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infeng_common.errors import InfengError

#: Roles a chat example may use; the loss covers ``assistant`` turns.
ROLES = ("system", "user", "assistant", "tool")
#: Label of a token the loss ignores (PyTorch's cross-entropy ``ignore_index``).
IGNORE = -100


class DataError(InfengError):
    """A training file that cannot be used: names the file and line."""


@dataclass
class FinetuneOptions:
    """What ``infeng finetune`` trains; the CLI flags are these fields."""

    model: str
    data: Path
    output: Path
    method: str = "lora"                       # lora | rslora | dora
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    epochs: float = 1.0
    max_steps: int = 0                         # > 0: overrides epochs
    batch_size: int = 4
    grad_accum: int = 1
    learning_rate: float = 2e-4
    warmup_steps: int = 0
    max_length: int | None = None              # default: the model's context
    eval_data: Path | None = None
    eval_fraction: float = 0.1                 # held out of data when eval_data is not given
    eval_steps: int = 0                        # 0: evaluate at the end only
    save_steps: int = 0                        # 0: a checkpoint at the end only
    resume: bool = False
    seed: int = 0
    threads: int = 0                           # 0: torch's default (one per core)
    bf16: bool | None = None                   # None: where the CPU has bf16 instructions

    def check(self) -> None:
        if self.method not in ("lora", "rslora", "dora"):
            raise InfengError(f"--method {self.method!r}: expected lora, rslora or dora")
        if not 0.0 <= self.dropout < 1.0:
            raise InfengError(f"--dropout {self.dropout}: expected a value in [0, 1)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise InfengError(f"--eval-fraction {self.eval_fraction}: expected a value in [0, 1)")
        if not self.target_modules:
            raise InfengError("--target-modules: name at least one module, e.g. q_proj,v_proj")


@dataclass
class Example:
    """One tokenized example: ``labels`` is ``input_ids`` with non-answer tokens set to IGNORE."""

    line: int
    input_ids: list[int]
    labels: list[int]


@dataclass
class TrainProgress:
    """What the progress display shows after each optimizer step."""

    step: int
    total_steps: int
    loss: float | None
    eval_loss: float | None
    tokens_per_s: float
    elapsed_s: float


@dataclass
class FinetuneResult:
    adapter_dir: Path
    steps: int
    train_examples: int
    eval_examples: int
    train_losses: list[float]                  # logged training loss, one per step
    eval_loss: float | None
    wall_s: float                              # training alone (model loading excluded)
    steps_per_s: float
    tokens_per_s: float


# -- data ---------------------------------------------------------------------------------------
def _messages_of(record: Any, where: str) -> list[dict[str, str]]:
    """The chat turns of one JSONL record (either format), checked."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\" or \"prompt\"/\"completion\"")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise DataError(f"{where}: message {i} has no \"role\"")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {i} ({m['role']}) has no text \"content\"")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message to learn from")
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and not m["content"].strip():
                raise DataError(f"{where}: message {i} (assistant) is an empty answer")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str):
            raise DataError(f"{where}: \"prompt\" must be a string")
        if not isinstance(completion, str) or not completion.strip():
            raise DataError(f"{where}: \"completion\" is missing or an empty answer")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    raise DataError(f"{where}: expected \"messages\" or \"prompt\"/\"completion\"")


def _answer_spans(tokenizer, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of the assistant turns in it.

    With a chat template, turn i's span runs from the end of ``messages[:i]`` rendered with the
    generation prompt to the end of ``messages[:i+1]``; each render must be a prefix of the whole
    (true of ChatML, Llama, Mistral ... templates). Without one, a prompt/completion pair is plain
    text and the completion is the span."""
    if not getattr(tokenizer, "chat_template", None):
        if [m["role"] for m in messages] != ["user", "assistant"]:
            raise DataError(f"{where}: the model has no chat template; use prompt/completion pairs")
        prompt, answer = messages[0]["content"], messages[1]["content"]
        eos = tokenizer.eos_token or ""
        return prompt + answer + eos, [(len(prompt), len(prompt) + len(answer) + len(eos))]

    def render(turns: list[dict[str, str]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        text = render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, end = render(messages[:i], True), render(messages[:i + 1], False)
            if not (text.startswith(start) and text.startswith(end) and len(end) > len(start)):
                raise DataError(f"{where}: the chat template does not render turn {i} as a prefix of the "
                                f"conversation; the answer tokens cannot be found")
            spans.append((len(start), len(end)))
    except DataError:
        raise
    except Exception as e:                         # the template's own error (jinja raise_exception)
        raise DataError(f"{where}: the chat template refused the messages: {e}") from None
    return text, spans


def tokenize_example(tokenizer, messages: list[dict[str, str]], max_length: int, line: int,
                     where: str) -> Example:
    """Token ids and labels (answer tokens only) of one conversation."""
    text, spans = _answer_spans(tokenizer, messages, where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    labels = [tok if any(s <= begin < e for s, e in spans) else IGNORE for tok, (begin, _) in zip(ids, offsets)]
    if len(ids) > max_length:
        raise DataError(f"{where}: {len(ids)} tokens, over the context of {max_length} (--max-length)")
    if all(label == IGNORE for label in labels):
        raise DataError(f"{where}: the answer has no tokens")
    return Example(line, ids, labels)


def read_examples(path: Path, tokenizer, max_length: int) -> list[Example]:
    """Every example of a JSONL file, or a DataError naming the first bad line (and how many more)."""
    path = Path(path)
    examples, errors = [], []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.read().splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            examples.append(tokenize_example(tokenizer, _messages_of(record, where), max_length, number, where))
        except DataError as e:
            errors.append(str(e))
    if errors:
        more = f" (and {len(errors) - 1} more bad lines)" if len(errors) > 1 else ""
        raise DataError(errors[0] + more)
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def split_examples(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded (train, eval) split holding out ``fraction`` of the examples (at least one, when
    the fraction is not 0 and two or more examples exist)."""
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(fraction * len(examples)))
    held = set(order[:n_eval])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


class _Collator:
    """Pads a batch on the right: pad id for inputs, IGNORE for labels, 0 in the attention mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[Example]) -> dict[str, Any]:
        import torch

        width = max(len(e.input_ids) for e in batch)
        ids = [e.input_ids + [self.pad_id] * (width - len(e.input_ids)) for e in batch]
        labels = [e.labels + [IGNORE] * (width - len(e.labels)) for e in batch]
        mask = [[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in batch]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}


# -- model --------------------------------------------------------------------------------------
def _source(model: str) -> tuple[str, dict[str, Any]]:
    """``from_pretrained``'s first argument and keywords for an HF dir, a hub id or a GGUF file."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InfengError(f"{model}: no such GGUF file")
        return str(path.parent), {"gguf_file": path.name}
    return model, {}


def load_tokenizer(model: str):
    """The model's tokenizer (a pad token set: the end-of-sequence token when it has none)."""
    import transformers

    source, kwargs = _source(model)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise InfengError(f"{model}: transformers cannot load its tokenizer: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model: str):
    """The transformers model in f32 (a GGUF dequantized)."""
    import torch
    import transformers

    source, kwargs = _source(model)
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as e:
        raise InfengError(f"{model}: transformers cannot load it: {str(e).splitlines()[0]}") from None
    if kwargs:
        # transformers dequantizes a GGUF into plain f32 tensors but still marks the model
        # quantized, which its Trainer refuses; the weights are ordinary parameters
        lm.hf_quantizer = None
        lm.is_quantized = False
        lm.config.__dict__.pop("quantization_config", None)
    return lm


def cpu_has_bf16() -> bool:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), where autocast pays off."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def lora_config(options: FinetuneOptions):
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=options.rank, lora_alpha=options.alpha,
                      lora_dropout=options.dropout, target_modules=list(options.target_modules),
                      use_rslora=options.method == "rslora", use_dora=options.method == "dora")


def _progress_callback(report: Callable[[TrainProgress], None], started: list[float]):
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        """Calls ``report`` after every optimizer step and every evaluation."""

        def __init__(self) -> None:
            self.loss: float | None = None
            self.eval_loss: float | None = None
            self.tokens0 = 0
            self.step0 = 0

        def on_train_begin(self, args, state, control, **kwargs):
            started[0] = time.perf_counter()
            self.step0 = state.global_step                 # > 0 after --resume
            self.tokens0 = state.num_input_tokens_seen or 0

        def _report(self, state) -> None:
            tokens = state.num_input_tokens_seen or 0
            elapsed = time.perf_counter() - started[0]
            report(TrainProgress(state.global_step, state.max_steps, self.loss, self.eval_loss,
                                 (tokens - self.tokens0) / elapsed if elapsed > 0 else 0.0, elapsed))

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                self.loss = float(logs["loss"])
            if "eval_loss" in logs:
                self.eval_loss = float(logs["eval_loss"])
            self._report(state)

    return Report()


def finetune(options: FinetuneOptions, report: Callable[[TrainProgress], None] = lambda p: None,
             stage: Callable[[str], None] = lambda s: None) -> FinetuneResult:
    """Train an adapter on ``options.data`` and save it in ``options.output``."""
    try:
        import torch
        import transformers
        from peft import get_peft_model
    except ImportError as e:
        raise InfengError(f"infeng finetune needs torch, transformers and peft ({e.name} is missing): "
                          f"pip install 'infeng[finetune]'") from None

    options.check()
    if not Path(options.data).is_file():
        raise InfengError(f"{options.data}: no such data file")
    output = Path(options.output)
    checkpoints = output / "checkpoints"
    if options.resume and not any(checkpoints.glob("checkpoint-*")):
        raise InfengError(f"--resume: no checkpoint in {checkpoints}")
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    transformers.set_seed(options.seed)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    stage("reading the data")                      # before the model: bad data fails fast
    tokenizer = load_tokenizer(options.model)
    source, kwargs = _source(options.model)
    config = transformers.AutoConfig.from_pretrained(source, **kwargs)
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    max_length = min(options.max_length or context, context)
    examples = read_examples(options.data, tokenizer, max_length)
    if options.eval_data is not None:
        train, held = examples, read_examples(options.eval_data, tokenizer, max_length)
    else:
        train, held = split_examples(examples, options.eval_fraction, options.seed)
    stage("loading the model")
    model = load_model(options.model)

    try:
        model = get_peft_model(model, lora_config(options))
    except ValueError as e:                         # a target module the model does not have
        raise InfengError(f"--target-modules {','.join(options.target_modules)}: {e}") from None
    bf16 = cpu_has_bf16() if options.bf16 is None else options.bf16
    steps_per_epoch = math.ceil(len(train) / (options.batch_size * options.grad_accum))
    total_steps = options.max_steps or max(1, math.ceil(options.epochs * steps_per_epoch))
    args = transformers.TrainingArguments(
        output_dir=str(checkpoints), use_cpu=True, bf16=bf16, seed=options.seed, data_seed=options.seed,
        per_device_train_batch_size=options.batch_size, per_device_eval_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum, learning_rate=options.learning_rate,
        warmup_steps=options.warmup_steps, max_steps=total_steps, logging_steps=1,
        eval_strategy="steps" if held and options.eval_steps else "no", eval_steps=options.eval_steps or None,
        save_strategy="steps", save_steps=options.save_steps or total_steps, save_total_limit=2,
        include_num_input_tokens_seen="all", disable_tqdm=True, report_to=[], remove_unused_columns=False,
        dataloader_num_workers=0)
    started = [time.perf_counter()]
    progress = _progress_callback(report, started)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=held or None,
                                   data_collator=_Collator(tokenizer.pad_token_id), callbacks=[progress])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)    # the display is ``report``
    stage("training")
    with warnings.catch_warnings():          # a GGUF's folder has no config.json for PEFT to compare vocabularies
        warnings.filterwarnings("ignore", message="Could not find a config file")
        trainer.train(resume_from_checkpoint=True if options.resume else None)
    wall = time.perf_counter() - started[0]
    steps_run = trainer.state.global_step - progress.step0
    tokens_run = (trainer.state.num_input_tokens_seen or 0) - progress.tokens0
    eval_loss = None
    if held:
        stage("evaluating")
        eval_loss = float(trainer.evaluate()["eval_loss"])
        report(TrainProgress(trainer.state.global_step, total_steps, None, eval_loss, 0.0, wall))
    # the model as given (a GGUF file, not its folder), so that infeng's check of the base matches
    model.peft_config["default"].base_model_name_or_path = str(options.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(output)
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    return FinetuneResult(output, trainer.state.global_step, len(train), len(held), losses, eval_loss, wall,
                          steps_run / wall if wall > 0 else 0.0, tokens_run / wall if wall > 0 else 0.0)
