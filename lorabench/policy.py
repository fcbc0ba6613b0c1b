"""The policy: a PEFT LoRA model on frozen base weights, its optimizer, and the flat adapter it
publishes after each update (`train(batch)`, then `adapter()`); its version is the number of updates.
A diverged update (non-finite, or ||dW|| above grpo.max_delta_ratio·||W||) raises UpdateDiverged.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .adapters import (
    LORA_DTYPE,
    AdapterError,
    AdapterLayout,
    FlatAdapter,
    base_weights,
    linear_shapes,
    plain_config,
    validate,
)
from .commits import cloned
from .loss import (
    causal_padding_mask,
    grpo_loss_terms,
    sent_ahead,
    token_budget_batches,
    token_logprobs,
    token_logprobs_and_entropy,
)
from .models import load_model, pick_device, quiet_peft, with_lora
from .rollout import RolloutBatch, round_up
from .rundir import ADAPTERS, CHECKPOINT, optimizer_problem
from .settings import REFUSED, ConfigError, Section, check, setting

COMPILED_WIDTH_MULTIPLE = 8   # micro-batch widths under grpo.compile=all (Policy.train)
_ADAPTER = "it defines the adapter's shape or scaling, which the checkpoint holds"


@dataclass
class LoraSettings(Section):
    """The `lora` section: the adapter the policy trains on its frozen base weights."""
    r: int = setting(16, "LoRA rank.", resume=REFUSED, why=_ADAPTER)
    alpha: int = setting(32, "LoRA alpha; the update is scaled by alpha / r.", resume=REFUSED, why=_ADAPTER)
    target_modules: str | list[str] = setting("all-linear", "'all-linear' or a list of module names "
                                              "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).",
                                              resume=REFUSED, why=_ADAPTER)
    dropout: float = setting(0.0, "LoRA dropout in [0, 1) (keep 0 so trainer and engine log-probs can match).",
                             resume=REFUSED, why=_ADAPTER)

    def problems(self) -> list[str]:
        found = [*check(self.r >= 1, f"lora.r={self.r}: the LoRA rank must be >= 1"),
                 *check(self.alpha > 0, f"lora.alpha={self.alpha}: must be > 0"),
                 *check(0 <= self.dropout < 1, f"lora.dropout={self.dropout}: must be in [0, 1) (a probability; "
                        f"keep 0 so trainer and engine log-probs can match)")]
        tm = self.target_modules
        if isinstance(tm, str):
            found += check(tm == "all-linear" or tm.isidentifier(),
                           f"lora.target_modules={tm!r}: use 'all-linear' or a list of module names such as "
                           f'["q_proj","v_proj"]; regular expressions cannot be sent to SGLang')
        else:
            found += check(len(tm) > 0 and all(isinstance(t, str) and t.isidentifier() for t in tm),
                           f"lora.target_modules={tm!r}: list plain module names such as q_proj, v_proj")
        return found


class UpdateDiverged(AdapterError):
    """A GRPO update is unusable; nothing of it was served, saved or checkpointed. `override`: the setting a new
    run could start with (e.g. 'grpo.lr=0.0001'); `past_bound`: the resume override without the bound, or ''."""

    def __init__(self, message: str, override: str = "", past_bound: str = ""):
        super().__init__(message)
        self.override, self.past_bound = override, past_bound


class Policy:
    """`init_seed` seeds the LoRA init. `beside`: a Policy whose model this one shares, adding its adapter as
    `adapter_name` (a policy group's one frozen base)."""

    def __init__(self, model_path: str, lora, grpo, dtype: str = "float32", device: str = "",
                 adapter_name: str = "default", init_seed: int | None = None, beside: Policy | None = None):
        self.device = beside.device if beside else pick_device(device)
        base = beside.model if beside else load_model(model_path, dtype, self.device)
        if init_seed is not None:
            torch.manual_seed(init_seed)
        if beside:   # one more adapter on the shared model's frozen base (group.parse_policies: names unique)
            with quiet_peft():
                base.add_adapter(adapter_name, _lora_config(base.get_base_model(), lora, model_path))
        self.model = base if beside else with_lora(base, _lora_config(base, lora, model_path), adapter_name)
        self.adapter_name = adapter_name
        self.lora_layers = LoraLayers(self.model, adapter_name, flatten=True)  # before the optimizer sees them
        self.bf16_lora = lora_compute_dtype(grpo.lora_compute, dtype) == "bfloat16"
        self.compile = compile_mode(grpo.compile, self.device)
        if beside is None and self.compile == "all":   # checkpointing goes inside each compiled layer
            _compile_decoder_layers(self.model, model_path, grpo.activation_checkpointing)
        elif beside is None and grpo.activation_checkpointing:
            _enable_activation_checkpointing(self.model)
        self.layout = self.lora_layers.layout
        own = {id(owner.weight): name for name, owner in zip(self.layout.names, self.lora_layers.owners)}
        for owner in self.lora_layers.owners:
            owner.weight.requires_grad_(True)
        self.params = [p for p in self.model.parameters() if id(p) in own]   # this adapter's, in model order
        self.param_names = [own[id(p)] for p in self.params]   # in the checkpoint: whose each moment is
        self.optimizer = torch.optim.AdamW(list(zip(self.param_names, self.params)), lr=grpo.lr, weight_decay=0.0)
        self.version, self.grpo, self.last_stats = 0, grpo, {}
        self.base_norms = _base_norms(self.model, self.layout)   # [modules], layout.modules' order

    def adapter(self) -> FlatAdapter:
        """The LoRA weights as a new FlatAdapter at the policy's version; UpdateDiverged beyond the bound."""
        adapter = self.lora_layers.snapshot(self.version)
        found = self._beyond_bound(adapter)
        if found is None:
            return adapter
        (module, ratio), stats = found, self.last_stats
        raise _diverged(
            self.grpo, f"GRPO step {adapter.version} diverged: its adapter changes {module} by ||dW||/||W|| = "
            f"{ratio:.3g}, above grpo.max_delta_ratio={self.grpo.max_delta_ratio:g} (loss "
            f"{stats.get('loss', math.nan):.3g}, gradient norm {stats.get('grad_norm', math.nan):.3g} before clipping "
            f"to {self.grpo.max_grad_norm:g}); the update was not served, saved or checkpointed.", ratio=ratio,
            offer="continue without the bound ({}) if an update this large is intended")

    @torch.no_grad()
    def delta_ratios(self, adapter: FlatAdapter) -> torch.Tensor:
        """[modules] ||dW||_F / ||W||_F, dW = (alpha/r)·B·A, in float64 (FlatAdapter.delta_squares)."""
        delta = adapter.scaling * adapter.delta_squares.sqrt()
        return delta / self.base_norms.to(delta.device)   # a checkpoint's adapter is read onto the CPU

    def _beyond_bound(self, adapter: FlatAdapter) -> tuple[str, float] | None:
        """(module, ratio) of the largest ||dW||/||W|| if it is non-finite or above grpo.max_delta_ratio."""
        bound = self.grpo.max_delta_ratio
        if not bound:
            return None
        ratios = self.delta_ratios(adapter)
        worst = int(ratios.nan_to_num(nan=math.inf).argmax())
        ratio = float(ratios[worst])
        return None if math.isfinite(ratio) and ratio <= bound else (self.layout.modules[worst], ratio)

    def diverged_output(self, adapter: FlatAdapter) -> UpdateDiverged:
        """The engine's log-probs under `adapter` are not finite: an update no bound stopped."""
        ratio = float(self.delta_ratios(adapter).max())
        return _diverged(self.grpo, f"GRPO step {adapter.version} diverged: under its adapter the engine's log-probs "
                         f"are not finite (its largest ||dW||/||W|| is {ratio:.3g}; grpo.max_delta_ratio="
                         f"{self.grpo.max_delta_ratio:g}); the update was rolled back, not saved or checkpointed.")

    def base_weights(self) -> dict[str, torch.Tensor]:
        return base_weights(self.model)

    def train(self, batch: RolloutBatch) -> dict[str, float]:
        """`grpo.epochs` optimizer steps on `batch` in micro-batches of at most `grpo.micro_batch_tokens`
        padded tokens; returns loss statistics, the trainer-vs-engine mismatch and `Diagnostics`."""
        grpo = self.grpo
        # compiled layers recompile when a width stops being a multiple of 8 (inductor guards on alignment)
        multiple = COMPILED_WIDTH_MULTIPLE if self.compile == "all" else 1
        batch = batch.to("cpu").padded_to_multiple(multiple)
        micro = token_budget_batches([round_up(n, multiple) for n in batch.lengths], grpo.micro_batch_tokens)
        # cut on the host, sent without waiting, statistics summed on the device: the loop never waits for the GPU
        parts = [batch.rows(index, multiple) for index in micro]
        old_logp: list[torch.Tensor] = []                           # per micro-batch [n, L-1] π_old: before the update
        stale = grpo.max_staleness > 0                              # sampled by an older adapter: weighted
        is_weight: list[torch.Tensor] = []                          # per micro-batch [n, L-1] min(π_old/π_sample, C)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)   # loss, clip_fraction, kl
        tokens = 0
        diagnostics = Diagnostics()
        self._activate()
        self.model.train()
        for epoch in range(grpo.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for j, (host, index) in enumerate(zip(parts, micro)):
                part = host.to(self.device)
                positions = host.completion_mask.bool()             # on the host: the head's rows without a sync
                mask = self._layer_mask(part)
                logp, entropy = self._logprobs(part, positions, mask, with_entropy=epoch == 0)
                with_ref = grpo.kl_beta > 0 or (epoch == 0 and grpo.kl_metric)
                ref = self._reference_logprobs(part, positions, mask) if with_ref else None
                if epoch == 0:   # the policy that sampled the batch
                    old_logp.append(logp.detach())
                    if stale:
                        weight = torch.exp(logp.detach() - part.engine_logprobs).clamp(max=grpo.tis_cap)
                        is_weight.append(weight * part.completion_mask)
                    diagnostics.add(logp.detach(), entropy, ref, part.completion_mask)
                loss, m = grpo_loss_terms(logp, old_logp[j], part.advantages, part.completion_mask, grpo.clip_eps,
                                          ref, grpo.kl_beta, is_weight[j] if stale else None)
                share = len(index) / batch.size
                if loss.requires_grad:   # not when no completion in the micro-batch has a token
                    (loss * share).backward()                       # micro-batches sum to the batch mean
                terms = [loss.detach(), m["clip_fraction"], m.get("kl", torch.zeros_like(loss))]
                sums += torch.stack([t.double() for t in terms]) * share / grpo.epochs
                tokens += int(host.attention_mask.sum())
            stats = self._clipped_step(sums, tokens)
        self.model.eval()
        self.version += 1
        old = _placed(old_logp, micro, batch.engine_logprobs.shape)   # [N, L-1] on the host
        if stale:   # NaN without completion tokens (the mean of none)
            sampled = batch.completion_mask.bool()
            stats["is_weight_mean"] = _placed(is_weight, micro, old.shape)[sampled].mean().item()
            truncated = torch.exp(old - batch.engine_logprobs)[sampled] > grpo.tis_cap
            stats["is_truncated_fraction"] = truncated.float().mean().item()
        return {**stats, **mismatch(old, batch), **diagnostics.means()}

    def _clipped_step(self, sums: torch.Tensor, tokens: int) -> dict[str, float]:
        """The epoch's end: clip, read the sums (the one device wait), refuse a non-finite update, step."""
        grpo = self.grpo
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, grpo.max_grad_norm)
        loss, clip, kl, norm = torch.cat([sums, grad_norm.double().reshape(1)]).tolist()
        stats = {"loss": loss, "clip_fraction": clip, "kl": kl, "tokens": tokens, "grad_norm": norm}
        self.last_stats = dict(stats)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.lora_layers.snapshot(self.version)   # non-finite weights already? it names the tensor
            raise _diverged(grpo, f"GRPO step {self.version + 1} diverged: loss {loss:.3g}, gradient norm {norm:.3g} "
                            f"(before clipping to grpo.max_grad_norm={grpo.max_grad_norm:g}); the update was not "
                            f"applied, served, saved or checkpointed.")
        self.optimizer.step()
        return stats

    def compile_now(self) -> None:
        """grpo.compile=all: compile what `train` runs by training on a dummy batch, then put back weights,
        optimizer, version and every RNG (the session calls it while the engine starts)."""
        if self.compile != "all":
            return
        saved, last_stats = self.snapshot(), self.last_stats
        with rngs_kept(self.device):
            self.train(_compile_batch())
        self.restore(saved)
        self.last_stats = last_stats

    def _activate(self) -> None:
        """This policy's adapter is the one the shared model's forward applies (a policy group)."""
        if len(self.model.peft_config) > 1:
            self.model.set_adapter(self.adapter_name)
            for p in self.params:   # PEFT's set_adapter freezes the other adapters only
                p.requires_grad_(True)

    def _logprobs(self, part: RolloutBatch, positions: torch.Tensor, mask: torch.Tensor, with_entropy: bool):
        """(log-probs [n, L-1] with gradients, entropies or None); the head only at `positions` (completion tokens)."""
        fn = token_logprobs_and_entropy if with_entropy else token_logprobs
        with self.compute(), torch._dynamo.config.patch(**_DYNAMO):
            out = fn(self.model, part.input_ids, mask, self.grpo.temperature, positions=positions,
                     compiled_head=self.compile != "off")
        return out if with_entropy else (out, None)

    def _layer_mask(self, part: RolloutBatch) -> torch.Tensor:
        """Compiled SDPA layers always get the [N, 1, L, L] mask (transformers drops a 2-D one that pads nothing,
        and the layer would compile again)."""
        if self.compile == "all" and self.model.config._attn_implementation == "sdpa":
            return causal_padding_mask(part.attention_mask)
        return part.attention_mask

    @torch.no_grad()
    def _reference_logprobs(self, part: RolloutBatch, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with self.model.disable_adapter(), self.compute(), torch._dynamo.config.patch(**_DYNAMO):
            return token_logprobs(self.model, part.input_ids, mask, self.grpo.temperature, positions=positions)

    @contextlib.contextmanager
    def compute(self):
        """grpo.lora_compute. bf16: autocast, without PEFT's cast of each LoRA input to fp32 (backward keeps it)."""
        if not self.bf16_lora:
            yield
            return
        from peft.helpers import disable_input_dtype_casting
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16), \
                disable_input_dtype_casting(self.model):
            yield

    def snapshot(self) -> tuple:
        """What a failed step must not change: LoRA weights, optimizer state, version."""
        return cloned(list(self.params)), cloned(self.optimizer.state_dict()), self.version

    @torch.no_grad()
    def restore(self, saved: tuple) -> None:
        params, optimizer, version = saved
        for p, value in zip(self.params, params):
            p.copy_(value)
        self.optimizer.load_state_dict(optimizer)
        self.version = version

    def state(self) -> dict:
        """Checkpoint state besides the adapter itself (which carries the version: the checkpoint's step)."""
        return {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}

    @torch.no_grad()
    def load(self, state: dict, adapter: FlatAdapter) -> None:
        """Resume: the adapter's values and version, the optimizer and RNG state, checked against this policy."""
        if adapter.layout != self.layout:
            raise AdapterError("the checkpoint's adapter has other tensors or shapes than this policy (a different "
                               "lora.r, target modules or base model); resume with the run's own config")
        group = state["optimizer"]["param_groups"][0]
        if "param_names" not in group:   # an older lorabench's checkpoint, in this policy's order
            group["param_names"] = self.param_names
            problem = optimizer_problem(state["optimizer"], self.layout)
            if problem:
                raise AdapterError(f"the checkpoint's {problem}; {_RESTORE}")
        elif group["param_names"] != self.param_names:
            raise AdapterError(f"the checkpoint's field 'optimizer' names its parameters in another order than this "
                               f"policy (its moments would be loaded onto other tensors); {_RESTORE}")
        for owner, value in zip(self.lora_layers.owners, adapter.tensors.values()):
            owner.weight.copy_(value.to(owner.weight.device, owner.weight.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.version = adapter.version
        if found := self._beyond_bound(adapter):   # a checkpoint written without this bound, or under a larger one
            raise _diverged(
                self.grpo, f"the checkpoint's adapter (step {self.version}) changes {found[0]} by ||dW||/||W|| = "
                f"{found[1]:.3g}, above grpo.max_delta_ratio={self.grpo.max_delta_ratio:g}: that update diverged, and "
                f"resuming would serve it; nothing was changed.", then=f" ({ADAPTERS}/step_<n> hold earlier adapters)",
                ratio=found[1], offer="resume without the bound ({}) if an adapter this large is intended")


_RESTORE = f"nothing was changed. Restore {CHECKPOINT} from a backup, or start a new run"
# below this ratio a divergence message offers to continue without the bound; far beyond, only a lower rate helps
OFFER_UNBOUNDED_BELOW = 10.0


def _diverged(grpo, message: str, then: str = "", ratio: float = math.inf, offer: str = "") -> UpdateDiverged:
    """`message`, then a lower rate for a new run (a tenth, at most the default) and, for a ratio below
    OFFER_UNBOUNDED_BELOW, the `offer` of no bound."""
    default = next(f.default for f in dataclasses.fields(grpo) if f.name == "lr")
    override = f"grpo.lr={min(grpo.lr / 10, default):g}"
    past = "grpo.max_delta_ratio=0" if offer and ratio < OFFER_UNBOUNDED_BELOW else ""
    return UpdateDiverged(f"{message} Lower grpo.lr (now {grpo.lr:g}; e.g. {override}) in a new run{then}"
                          + (", or " + offer.format(past) if past else ""), override, past)


@torch.no_grad()
def _base_norms(model, layout: AdapterLayout) -> torch.Tensor:
    """||W||_F of each adapted module's frozen base weight, in `layout.modules` order."""
    weights = base_weights(model)
    norms = torch.stack([weights[f"{m}.weight"].double().norm() for m in layout.modules])
    return norms.clamp_min(torch.finfo(torch.float64).tiny)   # a zero weight: any change is infinite


def _enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder layer, non-reentrant (newer transformers: activation_checkpointing_enable)."""
    base = model.get_base_model()
    enable = getattr(base, "activation_checkpointing_enable", None)
    with quiet_peft():
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_mode(setting: str, device: str) -> str:
    """grpo.compile resolved: 'auto' is 'all' on a CUDA GPU, 'off' elsewhere (a CPU compile needs a C++ compiler)."""
    if setting == "auto":
        return "all" if torch.device(device).type == "cuda" else "off"
    return setting


def rngs_kept(device: str):
    """A context: torch's CPU RNG and that of `device` (a CUDA GPU) as they are now, put back at its end."""
    return torch.random.fork_rng(devices=[torch.device(device).index or 0] if device.startswith("cuda") else [])


def _compile_batch() -> RolloutBatch:
    """Three padded rows of 14, 19 and 24 tokens (a prompt of 4): like a real micro-batch to the compile guards."""
    lengths, prompt, width = (14, 19, 24), 4, 24
    positions = torch.arange(width)
    attention = torch.stack([(positions < n).long() for n in lengths])                     # [3, 24]
    completion = torch.stack([((positions[1:] >= prompt) & (positions[1:] < n)).float() for n in lengths])
    input_ids = (10 + positions.repeat(3, 1) % 50) * attention                             # [3, 24]
    advantages = torch.tensor([1.0, -1.0, 0.5])
    return RolloutBatch(input_ids, attention, completion, torch.zeros(completion.shape), advantages, advantages)


def _compile_decoder_layers(model, model_path: str, checkpointing: bool) -> None:
    """torch.compile every decoder layer in place (dynamic), checkpointing inside the compiled forward."""
    decoder = model.get_base_model().get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ConfigError(f"grpo.compile=all: the model {model_path} ({type(decoder).__name__}) has no list of "
                          f"decoder layers to compile; set grpo.compile=head or off")
    for layer in layers:
        if checkpointing:
            layer.forward = _checkpointed(layer, layer.forward)
        layer.compile(dynamic=True)
    model.get_base_model().get_input_embeddings().register_forward_hook(_needing_grad)


def _needing_grad(embedding, inputs, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output made to need grad in training: layer 0 then compiles the graph the others do."""
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


# dynamo while the layers run: no graph break at a side effect inside a checkpoint, and room for a group's graphs
_DYNAMO = {key: value for key, value in {"skip_fwd_side_effects_in_bwd_under_checkpoint": True,
                                          "recompile_limit": 64}.items() if hasattr(torch._dynamo.config, key)}


def _checkpointed(layer, forward):
    """forward, recomputed in backward when it runs with gradients in training mode."""
    def run(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)
    return run


def lora_compute_dtype(setting: str, model_dtype: str) -> str:
    """grpo.lora_compute resolved: 'auto' follows the base model (bf16 base -> bf16 LoRA matmuls)."""
    if setting == "auto":
        return "bfloat16" if model_dtype == "bfloat16" else "float32"
    return setting


class Diagnostics:
    """Metrics of π_old over completion tokens: entropy of softmax(logits / T) in nats; kl_to_base: k3."""

    def __init__(self):
        self.sums = None   # [4] float64 on the batch's device: tokens, entropy, kl, kl tokens (summed, no sync)

    def add(self, logp, entropy, ref_logp, completion_mask) -> None:
        mask = completion_mask.float()                                         # [n, L-1]
        kl = kl_tokens = mask.new_zeros(())
        if ref_logp is not None:
            diff = ref_logp - logp                                             # [n, L-1]
            kl, kl_tokens = ((torch.exp(diff) - diff - 1) * mask).sum(), mask.sum()
        added = torch.stack([mask.sum(), (entropy * mask).sum(), kl, kl_tokens]).double()
        self.sums = added if self.sums is None else self.sums + added

    def means(self) -> dict[str, float | None]:
        """{'entropy': mean nats per completion token, 'kl_to_base': the same, or None if not measured}."""
        tokens, entropy, kl, kl_tokens = self.sums.tolist() if self.sums is not None else (0.0,) * 4
        return {"entropy": entropy / tokens if tokens else float("nan"),
                "kl_to_base": kl / kl_tokens if kl_tokens else None}


def mismatch(trainer_logp: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    """|trainer - engine| log-prob on the sampled tokens before the update (the max is a bf16 tail, no alarm)."""
    mask = batch.completion_mask.bool()
    gap = (trainer_logp - batch.engine_logprobs).abs().float()           # [N, L-1]
    diff = gap[mask]                                                      # [tokens]
    active_diff = gap[mask & (batch.advantages != 0)[:, None]]
    if diff.numel() == 0:
        return dict.fromkeys(("mismatch_mean", "mismatch_p99", "mismatch_max", "mismatch_active_mean"), float("nan"))
    return {"mismatch_mean": diff.mean().item(), "mismatch_p99": torch.quantile(diff[:2**24], 0.99).item(),
            "mismatch_max": diff.max().item(),
            "mismatch_active_mean": active_diff.mean().item() if active_diff.numel() else float("nan")}


def _placed(pieces: list[torch.Tensor], micro: list[list[int]], shape) -> torch.Tensor:
    """Micro-batch pieces [n_j, w_j] put back into one [N, L-1] tensor, brought to the host in one copy."""
    out = pieces[0].new_zeros(shape, dtype=torch.float32)
    for piece, index in zip(pieces, micro):
        out[sent_ahead(torch.tensor(index), out.device), :piece.shape[1]] = piece.float()
    return out.cpu()


def _lora_config(base, lora, model_path: str):
    from peft import LoraConfig
    targets = lora.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]  # one module name; PEFT would treat a bare string as a full-name regex
    if targets != "all-linear":  # fail loudly rather than silently adapt nothing
        have = sorted({name.split(".")[-1] for name in linear_shapes(base)} - {"lm_head"})
        missing = [t for t in targets if t not in have]
        if missing:
            raise ConfigError(f"lora.target_modules={lora.target_modules!r}: the model {model_path} has no module "
                              f"named {missing}; its linear modules are {have} (or use 'all-linear')")
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout, bias="none")


class LoraLayers:
    """The nn.Linear holding each LoRA tensor of a PEFT model, in layout order, validated. flatten=True makes
    every LoRA weight a view of one buffer (a snapshot is one clone); do it before an optimizer is built."""

    def __init__(self, model, adapter_name: str = "default", flatten: bool = False):
        found = {}
        for module_name, module in model.named_modules():
            for half in ("lora_A", "lora_B"):
                table = getattr(module, half, None)
                if isinstance(table, torch.nn.ModuleDict) and adapter_name in table:
                    found[f"{module_name}.{half}.weight"] = table[adapter_name]
        self.layout = AdapterLayout.of({name: owner.weight for name, owner in found.items()})
        modules = sorted({name.split(".lora_")[0].split(".")[-1] for name in self.layout.names})
        self.config = plain_config(model.peft_config[adapter_name], modules)
        validate({n: found[n].weight.detach() for n in self.layout.names}, self.config, linear_shapes(model))
        self.owners = [found[n] for n in self.layout.names]
        self.buffer = self._flatten() if flatten else None

    @torch.no_grad()
    def _flatten(self) -> torch.Tensor:
        weights = [owner.weight for owner in self.owners]
        buffer = self.layout.flatten({n: w.detach() for n, w in zip(self.layout.names, weights)}).to(LORA_DTYPE)
        for owner, weight, view in zip(self.owners, weights, self.layout.views(buffer).values()):
            owner.weight = torch.nn.Parameter(view, requires_grad=weight.requires_grad)
        return buffer

    @torch.no_grad()
    def snapshot(self, version: int = 0) -> FlatAdapter:
        """The current weights copied into one new flat buffer, checked finite (one device sync)."""
        if self.buffer is not None and all(   # no weight replaced (load_state_dict(assign=True)) since flattening
                w.weight.data_ptr() == self.buffer.data_ptr() + start * self.buffer.element_size()
                for w, start in zip(self.owners, self.layout.offsets)):
            buffer = self.buffer.clone()
        else:
            tensors = [owner.weight.detach() for owner in self.owners]
            for name, shape, t in zip(self.layout.names, self.layout.shapes, tensors):
                if tuple(t.shape) != shape:
                    raise AdapterError(f"adapter tensor {name} changed shape {shape} -> {tuple(t.shape)}; the LoRA "
                                       f"layers were replaced after they were indexed")
            buffer = torch.cat([t.reshape(-1) for t in tensors])
        adapter = FlatAdapter(buffer, self.layout, dict(self.config), version)
        adapter.check_finite()
        return adapter
