"""A zoo of Hugging Face transformers models trained on the tpu device against PyTorch CPU.

Each family is built from a tiny config (hidden size 32, 2 layers, batch 2, sequence 8; no
download, random init under a fixed seed, every dropout 0 so that CPU and tpu compute one
function), with the attention implementation transformers picks by default (``sdpa`` where the
model supports it, recorded in each report). :func:`run` trains it for ``STEPS`` AdamW steps three
ways and compares the tpu run with a CPU twin (``copy.deepcopy`` of the same initial model):

* ``eager``: ``model.to("tpu")``, ordinary training loop;
* ``fused``: the same loop with ``with tpurec.mode("fused"):`` around each step;
* ``compiled``: ``torch.compile(model, backend="tpu")`` for forward and backward, eager optimizer;
  ``generate`` with ``model.forward = torch.compile(model.forward, backend="tpu")`` (how
  transformers' docs compile a model for generation).

Checked: ``named_parameters()`` and ``state_dict()`` keys as on CPU after ``.to("tpu")``; the loss
at every step, every parameter's gradient after step 1 and every parameter after the last step
(:func:`judge`: ``TOL`` against CPU float32, or the float64 rule); for generative models, the tokens
of a greedy ``generate`` of ``NEW_TOKENS`` tokens equal to CPU's; in fused and compiled mode, no new
program after the ``WARMUP`` steps (``compile_requests``: a new program, compiled or read from the
disk cache). Fused mode's programs per step are measured and reported, and so are the first step's
wall time and where the warm-up's compile seconds went (by phase and kind of program): the run's
summary lists them per family and mode, and ``ZOO_COMPILE_JSON=path`` writes them as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import transformers

import tpurec
from tpurec.bench.compile_report import compile_since, summary_line

STEPS = 5
WARMUP = 2  # step 1 creates AdamW's state, step 2 is the first steady step
NEW_TOKENS = 4
BATCH, SEQ = 2, 8
VOCAB = 99
LR = 1e-3
# The project's float32 tolerance (tests/dense/opinfo_device.py's TOL): tpu vs CPU float32.
TOL = dict(rtol=1e-4, atol=1e-5)
# tests/dense/opinfo_device.py's float64 rule: a tensor that misses TOL passes when its largest
# error against CPU's float64 run is at most this many times CPU float32's own largest error.
FLOAT64_FACTOR = 2.0
MODES = ("eager", "fused", "compiled", "shadow")  # shadow: eager, every op checked against CPU (tpurec.debug)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: how to build it and feed it.

    Attributes:
        name: the zoo's name for it.
        build: returns the model (random init; called under ``torch.manual_seed``).
        inputs: returns the training batch (CPU tensors, labels included) from a generator.
        prompt: for generative models, the ``generate`` keyword arguments (CPU tensors) from a
            generator; None for the others.
        fused_programs: the programs a warm fused step runs (1: the whole step is one; more where
            the model reads a value that is not known on the host, docs/zoo.md).
    """

    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], dict[str, Any]]
    prompt: Callable[[torch.Generator], dict[str, Any]] | None = None
    fused_programs: int = 1


def _ids(g: torch.Generator, batch: int = BATCH, seq: int = SEQ, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (batch, seq), generator=g)


def _lm_inputs(g):
    ids = _ids(g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _prompt(g):
    ids = _ids(g, seq=5)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _seq2seq_inputs(g):
    ids = _ids(g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(g, seq=6)}


def _image_inputs(size: int, labels: int = 3):
    def inputs(g):
        return {
            "pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (BATCH,), generator=g),
        }

    return inputs


T = transformers

# Shared tiny sizes of the decoder LMs.
_LM = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_ENC = dict(  # BERT-like encoders
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _causal(model_cls, config_cls, **overrides) -> Callable[[], torch.nn.Module]:
    return lambda: model_cls(config_cls(**{**_LM, **overrides}))


def _bart():
    return T.BartForConditionalGeneration(
        T.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
        )
    )


def _t5():
    return T.T5ForConditionalGeneration(
        T.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )


def _whisper():
    return T.WhisperForConditionalGeneration(
        T.WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=8,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            d_model=32,
            max_source_positions=8,
            max_target_positions=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            apply_spec_augment=False,
        )
    )


def _whisper_inputs(g):
    return {
        "input_features": torch.randn(BATCH, 8, 16, generator=g),  # 2 * max_source_positions frames
        "labels": _ids(g, seq=6),
    }


def _whisper_prompt(g):
    return {"input_features": torch.randn(BATCH, 8, 16, generator=g)}


def _deepseek_v3():
    return T.DeepseekV3ForCausalLM(
        T.DeepseekV3Config(
            **{**_LM, "num_key_value_heads": 4},
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            v_head_dim=8,
            qk_nope_head_dim=8,
        )
    )


def _vit():
    return T.ViTForImageClassification(
        T.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            num_labels=3,
            **{k: v for k, v in _ENC.items() if k not in ("vocab_size", "max_position_embeddings")},
        )
    )


def _resnet():
    return T.ResNetForImageClassification(
        T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    )


def _efficientnet():
    return T.EfficientNetForImageClassification(
        T.EfficientNetConfig(
            image_size=32,
            width_coefficient=0.1,
            depth_coefficient=0.25,
            kernel_sizes=[3, 5],
            in_channels=[32, 16],
            out_channels=[16, 24],
            strides=[1, 2],
            num_block_repeats=[1, 2],
            expand_ratios=[1, 6],
            hidden_dim=128,
            dropout_rate=0.0,
            drop_connect_rate=0.0,
            num_labels=3,
        )
    )


def _convnext():
    return T.ConvNextForImageClassification(
        T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, drop_path_rate=0.0, num_labels=3)
    )


def _clip():
    return T.CLIPModel(
        T.CLIPConfig(
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=16,
                projection_dim=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=16,
                patch_size=4,
                projection_dim=16,
            ),
            projection_dim=16,
        )
    )


def _clip_inputs(g):
    ids = _ids(g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
        "return_loss": True,
    }


def _wav2vec2():
    return T.Wav2Vec2ForCTC(
        T.Wav2Vec2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            conv_dim=(16, 16),
            conv_stride=(4, 2),
            conv_kernel=(8, 3),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2,
            hidden_dropout=0.0,
            activation_dropout=0.0,
            attention_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            layerdrop=0.0,
            apply_spec_augment=False,
            mask_time_prob=0.0,
            pad_token_id=0,
            ctc_loss_reduction="mean",
        )
    )


def _wav2vec2_inputs(g):
    # 160 samples -> (160 - 8) / 4 + 1 = 39 -> (39 - 3) / 2 + 1 = 19 frames; 6 labels each.
    return {"input_values": torch.randn(BATCH, 160, generator=g), "labels": _ids(g, seq=6)}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("bert", lambda: T.BertForMaskedLM(T.BertConfig(**_ENC)), _lm_inputs),
        Family(
            "distilbert",
            lambda: T.DistilBertForMaskedLM(
                T.DistilBertConfig(
                    vocab_size=VOCAB,
                    dim=32,
                    n_layers=2,
                    n_heads=4,
                    hidden_dim=37,
                    max_position_embeddings=64,
                    dropout=0.0,
                    attention_dropout=0.0,
                    qa_dropout=0.0,
                    seq_classif_dropout=0.0,
                )
            ),
            _lm_inputs,
        ),
        Family("roberta", lambda: T.RobertaForMaskedLM(T.RobertaConfig(**{**_ENC, "pad_token_id": 1})), _lm_inputs),
        Family(
            "gpt2",
            lambda: T.GPT2LMHeadModel(
                T.GPT2Config(
                    vocab_size=VOCAB,
                    n_embd=32,
                    n_layer=2,
                    n_head=4,
                    n_positions=64,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    bos_token_id=1,
                    eos_token_id=2,
                    pad_token_id=0,
                )
            ),
            _lm_inputs,
            _prompt,
        ),
        Family("llama", _causal(T.LlamaForCausalLM, T.LlamaConfig), _lm_inputs, _prompt),
        Family("mistral", _causal(T.MistralForCausalLM, T.MistralConfig, sliding_window=4), _lm_inputs, _prompt),
        Family("qwen2", _causal(T.Qwen2ForCausalLM, T.Qwen2Config), _lm_inputs, _prompt),
        Family("qwen3", _causal(T.Qwen3ForCausalLM, T.Qwen3Config, head_dim=8), _lm_inputs, _prompt),
        Family("phi3", _causal(T.Phi3ForCausalLM, T.Phi3Config), _lm_inputs, _prompt),
        Family(
            "gemma2", _causal(T.Gemma2ForCausalLM, T.Gemma2Config, head_dim=8, sliding_window=4), _lm_inputs, _prompt
        ),
        Family(
            "gemma3",
            _causal(T.Gemma3ForCausalLM, T.Gemma3TextConfig, head_dim=8, sliding_window=4),
            _lm_inputs,
            _prompt,
        ),
        Family(
            "mixtral",
            _causal(T.MixtralForCausalLM, T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
            _lm_inputs,
            _prompt,
        ),
        Family(
            "qwen2_moe",
            _causal(
                T.Qwen2MoeForCausalLM,
                T.Qwen2MoeConfig,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
            ),
            _lm_inputs,
            _prompt,
        ),
        Family("deepseek_v3", _deepseek_v3, _lm_inputs, _prompt),
        Family("t5", _t5, _seq2seq_inputs, _prompt),
        # The decoder makes a float all-ones mask (no host mirror), so its padding check is a sync point.
        Family("bart", _bart, _seq2seq_inputs, _prompt, fused_programs=2),
        Family("whisper", _whisper, _whisper_inputs, _whisper_prompt),
        Family("vit", _vit, _image_inputs(16)),
        Family("clip", _clip, _clip_inputs),
        Family("resnet", _resnet, _image_inputs(32)),
        Family("convnext", _convnext, _image_inputs(32)),
        Family("efficientnet", _efficientnet, _image_inputs(32)),
        Family("wav2vec2", _wav2vec2, _wav2vec2_inputs),
    ]
}


# ----------------------------------------------------------------------------------- running


def _to(x, device=None, dtype=None):
    if isinstance(x, torch.Tensor):
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        return x.to(device) if device is not None else x
    return x


def _tree_to(d: dict, device=None, dtype=None) -> dict:
    return {k: _to(v, device, dtype) for k, v in d.items()}


def _host(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().to("cpu", copy=True)


@dataclasses.dataclass
class Trace:
    """What one training run produced (on the host)."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: dict[str, torch.Tensor | None] = dataclasses.field(default_factory=dict)  # after step 1
    params: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # after the last step
    tokens: torch.Tensor | None = None
    generate_error: str | None = None
    generate_traceback: str | None = None
    warm: dict[str, Any] = dataclasses.field(default_factory=dict)  # stats over the warm steps
    seconds: float = 0.0
    # Over the warm-up steps: where the compile seconds went (tpurec.bench.compile_report.compile_since).
    compile: dict[str, Any] = dataclasses.field(default_factory=dict)
    first_step_seconds: float = 0.0  # from the first step's start to its loss on the host


def initial(family: Family) -> tuple[torch.nn.Module, dict, dict | None]:
    """The family's initial model (seed 0), its batch and its prompt (seed 1), on CPU."""
    torch.manual_seed(0)
    model = family.build()
    model.train()
    g = torch.Generator().manual_seed(1)
    batch = family.inputs(g)
    prompt = family.prompt(g) if family.prompt else None
    return model, batch, prompt


def _generate(model, prompt: dict, device) -> torch.Tensor:
    model.eval()
    out = model.generate(
        **_tree_to(prompt, device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    model.train()
    return _host(out)


def train(
    model: torch.nn.Module,
    batch: dict,
    prompt: dict | None,
    device: str,
    mode: str = "eager",
    dtype: torch.dtype | None = None,
) -> Trace:
    """``STEPS`` AdamW steps of ``model`` (moved to ``device``) on ``batch``, in ``mode``; then greedy ``generate``."""
    started = time.perf_counter()
    trace = Trace()
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(device)
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = _tree_to(batch, device, dtype)
    forward = torch.compile(model, backend="tpu") if mode == "compiled" else model
    context = {"fused": lambda: tpurec.mode("fused"), "shadow": tpurec.debug.shadow}.get(mode, contextlib.nullcontext)
    before = tpurec.stats()
    first_step = time.perf_counter()
    for step in range(1, STEPS + 1):
        if step == WARMUP + 1:
            if device != "cpu":
                trace.compile = compile_since(before)
            tpurec.reset_stats()
        with context():
            optimizer.zero_grad()
            loss = forward(**batch).loss
            loss.backward()
            optimizer.step()
        trace.losses.append(_host(loss))
        if step == 1:
            trace.first_step_seconds = time.perf_counter() - first_step
            trace.grads = {n: _host(p.grad) for n, p in zip(names, model.parameters())}
    if device != "cpu":
        torch.tpu.synchronize()
        stats = tpurec.stats()
        warm = STEPS - WARMUP
        trace.warm = {
            "compile_requests": stats["compile_requests"],
            "compilations": stats["compilations"],
            "executions_per_step": stats["executions"] / warm,
            "fused_graphs_per_step": stats["fused_graphs"] / warm,
            "sync_points": dict(stats["sync_points"]),
            "host_fallbacks": dict(stats["host_fallbacks"]),
        }
    trace.params = {n: _host(p) for n, p in model.named_parameters()}
    if prompt is not None:
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend="tpu")
        try:
            with context():
                trace.tokens = _generate(model, prompt, device)
        except Exception as error:  # noqa: BLE001 (the report names it)
            trace.generate_error = _first_line(error)
            trace.generate_traceback = traceback.format_exc()
    trace.seconds = time.perf_counter() - started
    return trace


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:600]


# ------------------------------------------------------------------------------------ judging


def _within(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        torch.testing.assert_close(actual, expected, check_dtype=False, **TOL)
    except AssertionError:
        return False
    return True


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    d = (actual.double() - reference.double()).abs()
    return float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0


def judge(what: str, actual: torch.Tensor, expected: torch.Tensor, reference: Callable[[], torch.Tensor]) -> str | None:
    """None when tpu's ``actual`` matches CPU float32's ``expected``, else why not.

    Matches: within ``TOL``; or, by the float64 rule (tests/dense/opinfo_device.py), within ``TOL``
    of CPU's float64 result ``reference()`` or no farther from it (largest absolute difference)
    than ``FLOAT64_FACTOR`` times CPU float32 is.
    """
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} on tpu, {tuple(expected.shape)} on CPU"
    if _within(actual, expected):
        return None
    wide = reference()
    if _within(actual, wide):
        return None
    tpu_error, cpu_error = _max_error(actual, wide), _max_error(expected, wide)
    if tpu_error <= FLOAT64_FACTOR * cpu_error:
        return None
    return (
        f"{what}: max |tpu - cpu| {_max_error(actual, expected):.3g} (|cpu| max {float(expected.abs().max()):.3g}); "
        f"against float64 tpu errs by {tpu_error:.3g}, CPU float32 by {cpu_error:.3g}"
    )


@dataclasses.dataclass
class Report:
    family: str
    mode: str
    attn_implementation: str | None
    problems: list[str]
    warm: dict[str, Any]
    seconds: float
    tracebacks: list[str] = dataclasses.field(default_factory=list)  # of what raised, for diagnosis
    compile: dict[str, Any] = dataclasses.field(default_factory=dict)  # the warm-up steps' compile seconds
    first_step_seconds: float = 0.0  # the first step's wall time, compilation included

    def compile_line(self) -> str:
        """The time to the first finished step and where the warm-up's compile seconds went, in one line."""
        if not self.compile:
            return f"{self.family} {self.mode}: no compile record (training raised)"
        return f"{self.family} {self.mode}: first step {self.first_step_seconds:.2f} s; {summary_line(self.compile, top=3)}"


# Every run's report in this process, in order (tests/models/conftest.py prints their compile lines).
reports: list[Report] = []


_REFERENCES: dict[str, tuple[Trace, Callable[[], Trace]]] = {}


def references(family: Family):
    """CPU float32 trace and a lazy CPU float64 trace of the family (cached per process)."""
    if family.name not in _REFERENCES:
        model, batch, prompt = initial(family)
        cpu = train(copy.deepcopy(model), batch, prompt, "cpu")
        wide: list[Trace] = []

        def float64() -> Trace:
            if not wide:
                wide.append(train(copy.deepcopy(model), batch, None, "cpu", dtype=torch.float64))
            return wide[0]

        _REFERENCES[family.name] = (cpu, float64)
    return _REFERENCES[family.name]


def run(name: str, mode: str) -> Report:
    """Trains family ``name`` on tpu in ``mode`` and on CPU; every mismatch found, in words."""
    family = FAMILIES[name]
    cpu, float64 = references(family)
    model, batch, prompt = initial(family)
    problems: list[str] = []
    twin = copy.deepcopy(model)
    moved = copy.deepcopy(model).to("tpu")
    if len(list(moved.named_parameters())) != len(list(twin.named_parameters())):
        problems.append(
            f"named_parameters: {len(list(moved.named_parameters()))} on tpu, "
            f"{len(list(twin.named_parameters()))} on CPU (tied weights?)"
        )
    if list(moved.state_dict()) != list(twin.state_dict()):
        problems.append(
            f"state_dict keys differ: only tpu {sorted(set(moved.state_dict()) - set(twin.state_dict()))}, "
            f"only CPU {sorted(set(twin.state_dict()) - set(moved.state_dict()))}"
        )
    del moved
    attn = getattr(model.config, "_attn_implementation", None)
    try:
        tpu = train(model, batch, prompt, "tpu", mode)
    except Exception as error:  # noqa: BLE001 (the report names it)
        problems.append(f"training raised {_first_line(error)}")
        report = Report(name, mode, attn, problems, {}, 0.0, [traceback.format_exc()])
        reports.append(report)
        return report
    for step, (a, e) in enumerate(zip(tpu.losses, cpu.losses), 1):
        problems.append(judge(f"loss at step {step}", a, e, lambda s=step: float64().losses[s - 1]))
    for n, e in cpu.grads.items():
        a = tpu.grads.get(n)
        if (a is None) != (e is None):
            problems.append(
                f"grad of {n}: {'None' if a is None else 'a tensor'} on tpu, {'None' if e is None else 'a tensor'} on CPU"
            )
        elif a is not None:
            problems.append(judge(f"grad of {n} after step 1", a, e, lambda n=n: float64().grads[n]))
    for n, e in cpu.params.items():
        if n not in tpu.params:
            problems.append(f"parameter {n} missing on tpu")
            continue
        problems.append(judge(f"{n} after step {STEPS}", tpu.params[n], e, lambda n=n: float64().params[n]))
    if tpu.generate_error:
        problems.append(f"generate raised {tpu.generate_error}")
    elif prompt is not None and not torch.equal(tpu.tokens, cpu.tokens):
        problems.append(f"generate: {tpu.tokens.tolist()} on tpu, {cpu.tokens.tolist()} on CPU")
    if mode in ("fused", "compiled") and tpu.warm["compile_requests"]:
        problems.append(
            f"{tpu.warm['compile_requests']} new programs after {WARMUP} warm-up steps "
            f"({tpu.warm['compilations']} compiled)"
        )
    if mode == "fused" and tpu.warm["fused_graphs_per_step"] != family.fused_programs:
        problems.append(
            f"{tpu.warm['fused_graphs_per_step']} programs per warm fused step, not {family.fused_programs} "
            f"(sync points: {tpu.warm['sync_points']})"
        )
    if tpu.warm.get("host_fallbacks"):
        problems.append(f"host fallbacks in the warm steps: {tpu.warm['host_fallbacks']}")
    report = Report(
        name,
        mode,
        attn,
        [p for p in problems if p],
        tpu.warm,
        tpu.seconds,
        [tpu.generate_traceback] if tpu.generate_traceback else [],
        tpu.compile,
        tpu.first_step_seconds,
    )
    reports.append(report)
    return report
