"""The pretraining recipe: the shared sections plus the arithmetic that ties them together.

Every check names the field, the value and the arithmetic; nothing here changes a value.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import model_validator

from megacli.errors import UserError
from megacli.recipe.base import RecipeError, Section
from megacli.recipe.data_sections import DataSection, MaskingSection, TokenizerSection
from megacli.recipe.finetune_sections import LoRASection, PreferenceSection, SFTSection
from megacli.recipe.harness import TrainingEvalSection
from megacli.recipe.model import ModelSection
from megacli.recipe.stages import split_problem
from megacli.recipe.sections import (
    CheckpointSection,
    LaunchSection,
    OptimSection,
    ParallelSection,
    RunSection,
    TrainSection,
)


class TrainingRecipe(Section):
    """What `pretrain` (and `finetune`) run: a model, its layout and how to train it."""

    model: ModelSection = ModelSection()
    """Architecture."""
    parallel: ParallelSection = ParallelSection()
    """How the model and batch are split across processes."""
    launch: LaunchSection = LaunchSection()
    """Processes, nodes and device."""
    tokenizer: TokenizerSection = TokenizerSection(type="byte")
    """Tokenizer used to build the data (its vocabulary sizes the embedding)."""
    data: DataSection = DataSection()
    """Training data: a run names it (data.path, data.blend or data.mock: true) unless it gives sft."""
    sft: Optional[SFTSection] = None
    """Instruction data for finetuning (instead of data:)."""
    preference: Optional[PreferenceSection] = None
    """Preference pairs and the preference objective (DPO, IPO, SimPO) for finetuning (instead of data: or sft:)."""
    lora: Optional[LoRASection] = None
    """Train low-rank adapters instead of all weights (finetuning); null = full-parameter training."""
    masking: MaskingSection = MaskingSection()
    """bert/t5: how samples are masked."""
    train: TrainSection = TrainSection()
    """Batch sizes, steps, precision, evaluation and logging."""
    optim: OptimSection = OptimSection()
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Saving and resuming."""
    run: RunSection = RunSection()
    """Run directory."""
    eval: Optional[TrainingEvalSection] = None
    """lm-evaluation-harness tasks run on the model at each train.eval_interval (needs megacli[eval]);
    null = none."""

    trains: ClassVar[bool] = True  # a recipe that trains must name its data

    # ---- derived numbers (never stored) ----
    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def model_parallel_size(self) -> int:
        p = self.parallel
        return p.tensor * p.pipeline * p.context

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    @property
    def tokens_per_step(self) -> int:
        sequences = 2 if self.preference is not None else 1  # a preference pair is two sequences
        return sequences * self.train.global_batch_size * self.model.seq_length

    @property
    def layers_per_stage(self) -> list[int]:
        """Transformer layers on each pipeline stage."""
        return self.parallel.stage_layer_counts(self.model.num_layers)

    def with_sections(self, **sections: Section) -> "TrainingRecipe":
        """This recipe with other sections (each already validated, e.g. another ``parallel`` layout),
        put through every cross-field check a loaded recipe goes through; raises RecipeError as
        loading would. ``self`` is left as it is."""
        candidate = self.model_copy(update=sections)
        for name, decorator in type(self).__pydantic_decorators__.model_validators.items():
            if decorator.info.mode == "after":
                getattr(candidate, name)()
        return candidate

    @model_validator(mode="after")
    def _check_arithmetic(self):
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor
        if m.num_attention_heads % tp:
            raise RecipeError("parallel.tensor", tp, f"must divide model.num_attention_heads = {m.num_attention_heads} "
                              f"({m.num_attention_heads} % {tp} = {m.num_attention_heads % tp}); try a divisor such as "
                              f"{_largest_divisor(m.num_attention_heads, tp)}")
        if m.num_attention_heads % m.query_groups:
            raise RecipeError("model.num_query_groups", m.num_query_groups,
                              f"must divide model.num_attention_heads = {m.num_attention_heads}")
        if m.query_groups % tp:
            raise RecipeError("parallel.tensor", tp, f"must divide model.num_query_groups = {m.query_groups} "
                              f"(each tensor-parallel rank needs whole key/value heads)")
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise RecipeError("model.hidden_size", m.hidden_size,
                              f"must be divisible by model.num_attention_heads = {m.num_attention_heads} "
                              f"(or set model.kv_channels)")
        if m.ffn_size % tp:
            raise RecipeError("model.ffn_hidden_size", m.ffn_size, f"must be divisible by parallel.tensor = {tp}")
        self._check_layout()
        if m.position_embedding == "learned" and m.max_positions < m.seq_length:
            raise RecipeError("model.max_position_embeddings", m.max_position_embeddings,
                              f"is smaller than model.seq_length = {m.seq_length}")
        if m.mla is not None and p.context > 1:
            raise RecipeError("parallel.context", p.context, "multi-latent attention (model.mla) runs without context "
                              "parallelism (its ring attention needs keys and values of one head width)")
        if m.arch == "gpt" and m.position_embedding == "relative":
            raise RecipeError("model.position_embedding", "relative", "is for t5; gpt uses learned, rope, alibi or none")
        if self.tokenizer.type == "none" and m.vocab_size is None:
            raise RecipeError("model.vocab_size", None, "tokenizer.type: none needs an explicit model.vocab_size")
        horizon = self.optim.decay_horizon(t.iters)
        if self.optim.warmup_iters and self.optim.warmup_iters >= horizon:
            raise RecipeError("optim.warmup_iters", self.optim.warmup_iters,
                              f"must be shorter than the decay horizon (optim.decay_iters or train.iters = {horizon} steps)")
        if self.optim.optimizer == "muon" and t.precision == "fp16":
            raise RecipeError("optim.optimizer", "muon", "runs in fp32 or bf16, not train.precision = fp16")
        self._check_moe()
        if m.scale_decoder_output and m.arch != "t5":
            raise RecipeError("model.scale_decoder_output", True, f"is for t5 (its decoder output), not {m.arch}")
        if m.arch != "bert":
            for name, value, default in (("norm_position", m.norm_position, "pre"), ("bert_token_types", m.bert_token_types, None)):
                if value != default:
                    raise RecipeError(f"model.{name}", value, f"is for bert, not {m.arch}")
        if m.arch in ("bert", "t5"):
            self._check_bert_t5()
        if self.sft is not None:
            self._check_sft()
        elif self.preference is not None:
            self._check_preference()
        elif self.trains and not self.data.named:
            raise RecipeError("data", None, "the recipe names no training data: set data.path (a prefix from "
                              "`megacli preprocess`), data.blend, or data.mock: true for random tokens")
        if self.lora is not None:
            self._check_lora()
        return self

    def _check_layout(self) -> None:
        """The parallel layout against the model, the world size and the batch."""
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor
        problem = split_problem(m.num_layers, p.pipeline, p.virtual_pipeline, p.first_stage_layers, p.last_stage_layers)
        if problem:
            raise RecipeError(*problem)
        if p.virtual_pipeline and p.pipeline < 2:
            raise RecipeError("parallel.virtual_pipeline", p.virtual_pipeline, "interleaving needs parallel.pipeline >= 2")
        if self.world_size % self.model_parallel_size:
            raise RecipeError("launch.nproc", self.launch.nproc,
                              f"world size launch.nproc × launch.nnodes = {self.world_size} must be a multiple of "
                              f"tensor × pipeline × context = {tp} × {p.pipeline} × {p.context} = {self.model_parallel_size}")
        dp = self.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise RecipeError("train.global_batch_size", t.global_batch_size,
                              f"must be divisible by train.micro_batch_size × data-parallel size = "
                              f"{t.micro_batch_size} × {dp} = {per_step} (data-parallel size = world {self.world_size} / "
                              f"(TP {tp} × PP {p.pipeline} × CP {p.context}))")
        if p.virtual_pipeline and self.num_microbatches % p.pipeline:
            raise RecipeError("train.global_batch_size", t.global_batch_size,
                              f"the interleaved schedule needs micro-batches per step ({self.num_microbatches}) "
                              f"to be a multiple of parallel.pipeline = {p.pipeline}")
        if p.context > 1 and m.attention_softcap is not None:
            raise RecipeError("model.attention_softcap", m.attention_softcap, f"has no context-parallel ring attention "
                              f"yet: use parallel.context: 1 (got {p.context})")
        if p.sequence_parallel is True and tp == 1:
            raise RecipeError("parallel.sequence_parallel", True, "needs parallel.tensor > 1")
        if p.context > 1 and m.seq_length % (2 * p.context):
            raise RecipeError("model.seq_length", m.seq_length,
                              f"must be divisible by 2 × parallel.context = {2 * p.context} "
                              f"(each context-parallel rank holds two load-balanced chunks)")
        if p.sp_enabled and m.seq_length % (tp * p.context):
            raise RecipeError("model.seq_length", m.seq_length,
                              f"must be divisible by parallel.tensor × parallel.context = {tp * p.context} for sequence parallelism")
        if p.overlap_param_gather and not p.distributed_optimizer:
            raise RecipeError("parallel.overlap_param_gather", True, "needs parallel.distributed_optimizer: true")
        if p.distributed_optimizer and self.optim.optimizer == "muon" and self.train.precision != "bf16":
            raise RecipeError("parallel.distributed_optimizer", True, "with optim.optimizer = muon needs train.precision = "
                              "bf16: Megatron-Core's layer-wise optimizer keeps fp32 master weights of bf16 parameters")
        if p.overlap_param_gather and self.optim.optimizer == "muon":
            raise RecipeError("parallel.overlap_param_gather", True, "is for AdamW and SGD: muon's distributed "
                              "optimizer gathers the updated parameters after the step")

    @model_validator(mode="after")
    def _check_cuda_graphs(self):
        """A CUDA graph replays fixed shapes and launches; what varies from step to step stays out."""
        choice = self.train.cuda_graphs
        if choice == "none":
            return self
        m, p = self.model, self.parallel
        refusals = [
            (m.arch != "gpt", f"is for gpt pretraining, not {m.arch}"),
            (self.sft is not None, "instruction batches vary in shape (sft); use train.cuda_graphs: none"),
            (self.preference is not None, "preference tuning runs a reference model's pass between steps"),
            (m.moe is not None, "mixture-of-experts routing sizes each expert's batch on the host every step"),
            (self.eval is not None, "eval.tasks decode with the training model (other shapes than its steps)"),
            (choice == "layers" and p.recompute == "full", "full recomputation replays each layer's forward inside "
             "its backward, which a per-layer graph cannot hold (Megatron-Core allows it only with full)"),
            (choice == "layers" and bool(self.train.eval_interval) and (m.dropout or m.attention_dropout),
             "evaluation would replay the layers' graphs, captured in training mode with dropout: set "
             "train.eval_interval: null, model dropout 0, or use full (which captures evaluation apart)"),
            (choice == "full" and p.overlap_param_gather, "the parameter all-gather starts in the optimizer step, "
             "outside the graph, and would be waited for inside it: set parallel.overlap_param_gather: false"),
            (choice == "layers" and self.train.compile and p.overlap_param_gather, "with train.compile the "
             "parameter all-gather waits run in a hook of megacli's on each layer, which Megatron-Core's layer "
             "graphs refuse: set parallel.overlap_param_gather: false"),
            (choice == "full" and p.pipeline > 1, "the full-iteration graph is for one pipeline stage "
             "(parallel.pipeline: 1); use layers"),
            (choice == "full" and p.context > 1, "the full-iteration graph is for parallel.context: 1; use layers"),
        ]
        for refused, why in refusals:
            if refused:
                raise RecipeError("train.cuda_graphs", choice, why)
        return self

    @model_validator(mode="after")
    def _check_training_eval(self):
        """eval.tasks run the training model itself, in its layout, through the decoding runner."""
        if self.eval is None or not self.trains:
            return self
        m, p = self.model, self.parallel
        why = "eval.tasks run the training model as it is laid out, through the decoding runner"
        if m.arch != "gpt":
            raise RecipeError("eval.tasks", self.eval.tasks, f"harness tasks during training are for gpt, not {m.arch}")
        if not self.train.eval_interval:
            raise RecipeError("train.eval_interval", self.train.eval_interval,
                              "eval.tasks run at each train.eval_interval: set one (or drop eval:)")
        if p.virtual_pipeline not in (None, 1):
            raise RecipeError("parallel.virtual_pipeline", p.virtual_pipeline, f"{why}, which runs without interleaving")
        if p.context != 1:
            raise RecipeError("parallel.context", p.context, f"{why}, which runs without context parallelism")
        if p.sp_enabled:
            raise RecipeError("parallel.sequence_parallel", p.sequence_parallel,
                              f"{why}; sequence parallelism splits the sequence over tensor-parallel ranks, which a "
                              f"decoding step of one token cannot be: set parallel.sequence_parallel: false")
        return self

    @property
    def expert_tensor_size(self) -> int:
        """Tensor-parallel size inside the experts (parallel.expert_tensor, default parallel.tensor)."""
        return self.parallel.expert_tensor or self.parallel.tensor

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert: the ranks of a pipeline stage / (expert tensor × expert parallel)."""
        return self.world_size // self.parallel.pipeline // (self.expert_tensor_size * self.parallel.expert)

    def _check_moe(self) -> None:
        """Expert parallelism re-slices each pipeline stage's TP × CP × DP ranks as ETP × EP × expert-DP."""
        m, p = self.model, self.parallel
        moe = m.moe
        if moe is None:
            if p.expert > 1:
                raise RecipeError("parallel.expert", p.expert, "expert parallelism needs experts: set model.moe "
                                  "(e.g. model.moe.num_experts: 8), or parallel.expert: 1")
            if p.expert_tensor is not None and p.expert_tensor != p.tensor:
                raise RecipeError("parallel.expert_tensor", p.expert_tensor, "is for MoE models (model.moe)")
            return
        if m.arch != "gpt":
            raise RecipeError("model.moe", f"num_experts: {moe.num_experts}", f"mixture of experts is for gpt, not {m.arch}")
        if moe.num_experts % p.expert:
            raise RecipeError("parallel.expert", p.expert,
                              f"must divide model.moe.num_experts = {moe.num_experts} ({moe.num_experts} % {p.expert} = "
                              f"{moe.num_experts % p.expert}); try {_largest_divisor(moe.num_experts, p.expert)}")
        etp = self.expert_tensor_size
        stage_ranks = self.world_size // p.pipeline  # TP × CP × DP
        if stage_ranks % (etp * p.expert):
            raise RecipeError("parallel.expert", p.expert,
                              f"expert tensor × expert parallel = {etp} × {p.expert} = {etp * p.expert} must divide the "
                              f"ranks of a pipeline stage, tensor × context × data-parallel = {p.tensor} × {p.context} × "
                              f"{self.data_parallel_size} = {stage_ranks} (world {self.world_size} / pipeline {p.pipeline})")
        if m.expert_ffn_size % etp:
            raise RecipeError("model.moe.ffn_hidden_size", m.expert_ffn_size,
                              f"must be divisible by the expert tensor-parallel size {etp}")
        if moe.shared_expert_ffn_hidden_size and moe.shared_expert_ffn_hidden_size % p.tensor:
            raise RecipeError("model.moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size,
                              f"must be divisible by parallel.tensor = {p.tensor}")
        if m.add_bias_linear and (moe.shared_expert_ffn_hidden_size or etp > 1):
            why = "a shared expert" if moe.shared_expert_ffn_hidden_size else f"expert tensor parallelism ({etp})"
            raise RecipeError("model.add_bias_linear", True, f"Megatron-Core supports no linear biases with {why}: set "
                              "model.add_bias_linear: false (model.add_qkv_bias still works)")
        if isinstance(moe.layer_freq, list) and len(moe.layer_freq) != m.num_layers:
            raise RecipeError("model.moe.layer_freq", moe.layer_freq,
                              f"has {len(moe.layer_freq)} entries for model.num_layers = {m.num_layers} layers")
        if p.tensor > 1 and not p.sp_enabled and self.trains:  # decoding runs them without (one token cannot be split)
            raise RecipeError("parallel.sequence_parallel", False,
                              "MoE layers with parallel.tensor > 1 need sequence parallelism (Megatron-Core refuses "
                              "to train them without): set parallel.sequence_parallel: auto (or true)")

    def _check_sft(self) -> None:
        if self.model.arch != "gpt":
            raise RecipeError("sft", self.sft.train, f"instruction finetuning is for gpt models, not {self.model.arch}")
        if self.preference is not None:
            raise RecipeError("preference", self.preference.train, "give sft (instruction data) or preference "
                              "(preference pairs), not both")
        if self.data.prefixes or self.data.on_the_fly:
            raise RecipeError("sft", self.sft.train, "give sft (instruction data) or data.path/data.blend (continued "
                                                     "pretraining), not both")
        if self.data.named_valid:
            raise RecipeError("data.valid", self.data.valid, "instruction finetuning names its validation sets in "
                              "sft.valid (a map name -> JSONL file)")
        if self.parallel.context > 1:
            raise RecipeError("parallel.context", self.parallel.context,
                              "packed instruction data needs per-example attention masks; context parallelism "
                              "does not support them yet")
        if self.tokenizer.type == "none":
            raise RecipeError("tokenizer.type", "none", "instruction data is text: it needs a real tokenizer")

    def _check_preference(self) -> None:
        pref = self.preference
        if self.model.arch != "gpt":
            raise RecipeError("preference", pref.train, f"preference tuning is for gpt models, not {self.model.arch}")
        if self.data.prefixes or self.data.on_the_fly or self.data.named_valid:
            raise RecipeError("preference", pref.train, "give preference (pairs) or data (token streams), not both")
        if self.parallel.context > 1:
            raise RecipeError("parallel.context", self.parallel.context,
                              "preference tuning runs without context parallelism")
        if self.tokenizer.type == "none":
            raise RecipeError("tokenizer.type", "none", "preference pairs are text: they need a real tokenizer")
        if pref.max_length is not None and pref.max_length > self.model.seq_length + 1:
            raise RecipeError("preference.max_length", pref.max_length,
                              f"must be at most model.seq_length + 1 = {self.model.seq_length + 1}")
        if pref.reference == "base" and pref.loss != "simpo" and self.lora is None:
            raise RecipeError("preference.reference", "base", "base is the LoRA model with its adapters switched "
                              "off: add a lora section, or use copy or precompute")
        if pref.label_smoothing and pref.loss == "ipo":
            raise RecipeError("preference.label_smoothing", pref.label_smoothing, "is for dpo and simpo, not ipo")

    def _check_lora(self) -> None:
        if self.model.arch != "gpt":
            raise RecipeError("lora", self.lora.targets, f"LoRA adapters are for gpt models, not {self.model.arch}")
        if self.checkpoint.pretrained is None:
            raise RecipeError("checkpoint.pretrained", None, "LoRA trains adapters on top of pretrained weights: "
                              "name the checkpoint to start from (e.g. one from `megacli convert`)")
        mlp = [t for t in self.lora.targets if t in ("linear_fc1", "linear_fc2")]
        if self.model.moe is not None and mlp:
            raise RecipeError("lora.targets", self.lora.targets, f"the MLP of a mixture-of-experts model has no "
                              f"{' or '.join(mlp)} to adapt; target the attention (linear_qkv, linear_proj)")
        if self.model.mla is not None and "linear_qkv" in self.lora.targets:
            raise RecipeError("lora.targets", self.lora.targets, "multi-latent attention (model.mla) has no linear_qkv; "
                              "of its projections only linear_proj takes an adapter")

    def check_trainable(self) -> None:
        """What only training needs, checked by pretrain and finetune (also under --dry-run) but not by
        validation, so a converted BERT or T5 without tokenizer files still gets its recipe."""
        if self.model.arch in ("bert", "t5") and self.tokenizer.type == "none":
            raise UserError(f"tokenizer.type = 'none': {self.model.arch} masking needs a tokenizer with special tokens "
                            "(a WordPiece vocab, a Hugging Face tokenizer with them, sentencepiece or byte)")

    def _check_bert_t5(self) -> None:
        """What Megatron-Core 0.16.1's BertModel/T5Model and their masked datasets support."""
        m, p, arch = self.model, self.parallel, self.model.arch
        if self.data.on_the_fly:
            raise RecipeError("data.source", self.data.source, f"on-the-fly data is packed for gpt; {arch} trains on "
                              "sentence-split indexed data (`megacli preprocess --split-sentences`)")
        if self.data.named_valid:
            raise RecipeError("data.valid", self.data.valid, f"named validation sets are for gpt, not {arch}")
        if self.data.mock:
            raise RecipeError("data.mock", True, f"{arch} trains on sentence-split indexed data (Megatron's masked "
                              "WordPiece datasets have no mock variant): build it with `megacli preprocess "
                              "--split-sentences` and set data.path to the PREFIX_text_sentence dataset")
        if p.context > 1:
            raise RecipeError("parallel.context", p.context, f"context parallelism is for gpt; {arch} supports "
                              "tensor, pipeline (bert), sequence and data parallelism")
        positions = {"bert": ("learned", "rope"), "t5": ("learned", "rope", "relative")}[arch]
        if m.position_embedding not in positions:
            raise RecipeError("model.position_embedding", m.position_embedding,
                              f"Megatron-Core's {arch} supports {', '.join(positions)}")
        if arch == "bert":
            return
        if p.pipeline > 1:
            raise RecipeError("parallel.pipeline", p.pipeline,
                              "Megatron-Core 0.16.1 cannot pipeline T5: its schedules pass one activation between "
                              "stages and no longer split encoder and decoder stages (pipeline_model_parallel_split_rank "
                              "is gone; Megatron-LM's pretrain_t5.py refuses PP > 1 too). Use parallel.pipeline: 1 with "
                              "tensor, sequence and data parallelism")
        dec = m.dec_seq_length
        if m.position_embedding == "learned" and m.max_positions < dec:
            raise RecipeError("model.max_position_embeddings", m.max_position_embeddings,
                              f"is smaller than the decoder length model.decoder_seq_length = {dec}")
        if p.sp_enabled and dec % p.tensor:
            raise RecipeError("model.decoder_seq_length", dec,
                              f"must be divisible by parallel.tensor = {p.tensor} for sequence parallelism")
        most = self.masking.max_masked(m.seq_length, arch)
        if dec < most + 2:
            raise RecipeError("model.decoder_seq_length", dec,
                              f"cannot hold a sample's targets: <bos>, up to {most} masked tokens (masking.probability "
                              f"{self.masking.probability} × (seq_length {m.seq_length} - 2)) and a sentinel per span "
                              f"need at least {most + 2}, up to {2 * most + 1} when every span is one token")
        if self.masking.sentinel_tokens < most:
            raise RecipeError("masking.sentinel_tokens", self.masking.sentinel_tokens,
                              f"a sample can have up to {most} masked spans, each needing its own sentinel")


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, below + 1) if n % d == 0)
