"""DeepSeek-V3's decoder, with no distributed code.

Parameter names equal Hugging Face's ``DeepseekV3ForCausalLM`` names (``model.layers.N.self_attn.
kv_a_proj_with_mqa.weight``, ``model.layers.N.mlp.experts.E.gate_proj.weight``,
``model.layers.N.mlp.shared_experts.up_proj.weight``, ...), except two the family's ``hf_name`` maps:
the router's balancing bias (``mlp.gate.expert_bias``, Hugging Face's ``e_score_correction_bias``)
and the multi-token-prediction modules (``mtp.K.*``, DeepSeek's ``model.layers.{L + K}.*``).

The block is Llama's pre-norm block (two RMSNorms, the sequential residual) with multi-head latent
attention (:class:`DeepseekV3Attention`) and, from ``first_k_dense_replace`` on, an MoE layer of
:mod:`plait.nn.moe` (the sigmoid, group-limited :class:`~plait.nn.moe.router.SigmoidTopKRouter`
and the shared experts). The attention's weight-free middle is the shared
:class:`~plait.nn.attention.AttentionCore` on heads laid out by
:func:`~plait.nn.latent_attention.latent_heads`, so packing, the KV cache and context parallelism
take the same path as every family's.

Multi-token prediction (:class:`MultiTokenPrediction`, DeepSeek-V3 section 2.2): module ``k``
(1-based) combines the previous depth's hidden state at position ``t`` (the decoder's normalised
output for ``k = 1``) with the embedding of token ``t + k``, runs one block and predicts token
``t + k + 1`` through the model's own head. :func:`mtp_loss` adds ``mtp_loss_weight`` times the
mean of the depths' losses to the objective's gradient and keeps the returned loss the next-token
one, so the MTP loss is logged apart (:class:`MtpStats`) and a run compares with any other family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.deepseek_v3.config import LATENT_NORM_EPS, DeepseekV3Config
from plait.models.llama.model import LlamaForCausalLM, LlamaMLP
from plait.models.mixtral.model import MoEDecoderLayer, MoEModel
from plait.nn.attention import AttentionCore, query_scale_for
from plait.nn.latent_attention import latent_heads
from plait.nn.moe import ExpertMLP, MoELayer, SigmoidTopKRouter
from plait.nn.moe.losses import add_loss_gradient
from plait.nn.norm import RMSNorm
from plait.nn.recompute import recomputing


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention (see :mod:`plait.nn.latent_attention`).

    ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` without ``q_lora_rank``);
    ``kv_a_proj_with_mqa`` gives the latent (normalised by ``kv_a_layernorm``) and the shared rotary key
    part; ``kv_b_proj`` expands the latent to every head's key part and value; ``o_proj`` over the values.
    The softmax scale (``qk_head_dim ** -0.5``, YaRN's ``mscale`` squared) is a factor on the queries.
    """

    def __init__(self, config: DeepseekV3Config, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        h, n, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.interleave = config.kv_lora_rank, config.rope_interleave
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * config.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(config.q_lora_rank, n * config.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + self.rope_dim, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, n * (self.nope_dim + self.v_dim), bias=False, **kw)
        self.o_proj = nn.Linear(n * self.v_dim, h, bias=bias, **kw)
        self.query_scale = query_scale_for(config.qk_head_dim, config.softmax_scale)
        self.core = AttentionCore(config.attention_dropout)
        #: set while a decoding engine generates: the latent cache (:mod:`plait.inference.latent_cache`)
        self.latent_cache: Callable[..., torch.Tensor] | None = None

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q: torch.Tensor = self.q_proj(x)
            return q
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def compress_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised latent ``[batch, seq, kv_lora_rank]`` and the rotary key part ``[batch, seq, rope]``."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        latent, k_rope = self.compress_kv(x)
        if self.latent_cache is not None:
            assert mask is None, "a cached forward builds its own mask (packed rows are not generated)"
            out = self.latent_cache(self.project_q(x), latent, k_rope, self.kv_b_proj.weight, nope_dim=self.nope_dim,
                                    v_dim=self.v_dim, interleave=self.interleave, cos=cos, sin=sin,
                                    scale=self.query_scale * (self.nope_dim + self.rope_dim) ** -0.5)
            return self.o_proj(out)
        q, k, v = latent_heads(self.project_q(x), self.kv_b_proj(latent), k_rope, nope_dim=self.nope_dim,
                               rope_dim=self.rope_dim, v_dim=self.v_dim, interleave=self.interleave)
        return self.o_proj(self.core(q * self.query_scale, k, v, cos, sin, mask))


class DeepseekV3DecoderLayer(MoEDecoderLayer):
    """Llama's pre-norm block with latent attention; a dense MLP before ``first_k_dense_replace``, an MoE
    layer (sigmoid group-limited router, shared experts) from there on."""

    attention_cls = DeepseekV3Attention
    ffn_name = "mlp"

    def build_ffn(self, config: DeepseekV3Config, layer_id: int, device=None, dtype=None) -> nn.Module:
        if not config.is_moe_layer(layer_id):
            return LlamaMLP(config, device=device, dtype=dtype)
        router = SigmoidTopKRouter(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                                   renormalize=config.norm_topk_prob, scale=config.routed_scaling_factor,
                                   num_groups=config.n_group, topk_groups=config.topk_group, device=device,
                                   dtype=dtype)
        return MoELayer(config.hidden_size, config.n_routed_experts, config.moe_intermediate_size, router,
                        expert_cls=ExpertMLP, shared_intermediate_size=config.shared_expert_intermediate_size,
                        shared_expert_gate=config.shared_expert_gate, shared_name="shared_experts", device=device,
                        dtype=dtype)


class DeepseekV3Model(MoEModel):
    layer_cls = DeepseekV3DecoderLayer


class SharedHead(nn.Module):
    """DeepSeek's ``shared_head`` of a prediction module: its output norm (the head itself is the model's)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.norm: nn.Module = RMSNorm(hidden_size, eps, device=device, dtype=dtype)


class MultiTokenPrediction(DeepseekV3DecoderLayer):
    """One multi-token-prediction module: a decoder block (numbered after the decoder's, so sparse
    like DeepSeek's) fed ``eh_proj([enorm(embedding), hnorm(previous hidden)])``; ``shared_head.norm``
    normalises its output before the model's head."""

    pipeline_block: ClassVar[bool] = False  # it follows the head, on the last stage
    shared_head: SharedHead

    def __init__(self, config: DeepseekV3Config, device=None, dtype=None, *, layer_id: int = 0) -> None:
        super().__init__(config, device=device, dtype=dtype, layer_id=layer_id)
        kw = {"device": device, "dtype": dtype}
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps, **kw)
        self.hnorm = RMSNorm(h, eps, **kw)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, **kw)
        self.shared_head = SharedHead(h, eps, **kw)

    def predict(self, previous: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """This depth's hidden state (before ``shared_head.norm``) from the previous depth's and the
        embedding of the tokens ``k`` places ahead."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(previous)), dim=-1))
        return self.forward(x, cos, sin, mask)


@dataclass
class MtpStats:
    """Device-side sums since the last read: per depth the summed cross-entropy and the counted targets."""

    loss_sum: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def zeros(cls, depths: int, device: torch.device) -> MtpStats:
        return cls(torch.zeros(depths, device=device), torch.zeros(depths, device=device))


def mtp_inputs(labels: torch.Tensor, segment_ids: torch.Tensor | None, k: int,
               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth ``k``'s token ids (token ``t + k`` at position ``t``) and its labels in the output module's
    convention (``labels_k[t + 1]`` is the target of position ``t``: token ``t + k + 1``).

    The tokens come from ``labels`` (on a pipeline's last stage the labels are all there is), so a
    position counts only when its input token and its target are both labelled and, in a packed row,
    belong to its own sample; the other positions read token 0 and are ignored.
    """
    ahead = F.pad(labels[:, k:], (0, k), value=ignore_index)  # [t] = labels[t + k]: token t + k (and target t + k - 1)
    tokens = torch.where(ahead != ignore_index, ahead, 0)
    # target[j] = labels[j + k] is the target of position j - 1; it counts when that position's token is known
    # and, in a packed row, the target belongs to the same sample as position j - 1
    keep = F.pad(ahead[:, :-1] != ignore_index, (1, 0), value=False)
    if segment_ids is not None:
        keep = keep & (F.pad(segment_ids[:, k:], (0, k), value=-1) == F.pad(segment_ids[:, :-1], (1, 0), value=-2))
    return tokens, torch.where(keep, ahead, ignore_index)


def mtp_loss(modules: nn.ModuleList, hidden: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, *,
             embed: nn.Module, head: nn.Module, output: nn.Module, side: tuple, segment_ids: torch.Tensor | None,
             loss_normalizer: float | None, weight: float, stats: MtpStats | None) -> torch.Tensor:
    """``loss`` unchanged, with ``weight`` times the mean of the depths' losses in its backward.

    ``hidden``: the decoder's normalised output; ``side``: what the blocks receive after the hidden
    state (rotary tables, mask). Each depth's loss is its summed cross-entropy over its counted
    targets divided by ``loss_normalizer`` (the step's target tokens, as the next-token loss is) or by
    its own count; ``stats`` (training forwards only) keeps the sums for logging.
    """
    depths: list[torch.Tensor] = []
    sums, counts = [], []
    previous = hidden
    for k, module in enumerate(modules, start=1):
        tokens, target = mtp_inputs(labels, segment_ids, k)
        assert isinstance(module, MultiTokenPrediction)
        previous = module.predict(previous, embed(tokens), *side)
        total = output(head(module.shared_head.norm(previous)), target, 1.0)  # the summed cross-entropy
        count = (target[:, 1:] != -100).sum()
        depths.append(total / (loss_normalizer if loss_normalizer is not None else count.clamp(min=1)))
        sums.append(total.detach())
        counts.append(count)
    if stats is not None and not recomputing():
        stats.loss_sum += torch.stack(sums).float()
        stats.targets += torch.stack(counts).float()
    return add_loss_gradient(loss, torch.stack(depths).mean(), weight)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Decoder, output head and the multi-token-prediction modules (``mtp``; empty without them).

    ``mtp_stats`` (``None`` by default) is set by training to collect the MTP loss; the MTP modules
    run only for a next-token loss in training mode (an evaluation or generation forward skips them).
    """

    config: DeepseekV3Config
    model_cls = DeepseekV3Model

    def __init__(self, config: DeepseekV3Config, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.mtp = nn.ModuleList(MultiTokenPrediction(config, device=device, dtype=dtype,
                                                      layer_id=config.num_hidden_layers + k)
                                 for k in range(config.num_nextn_predict_layers))
        self.mtp_stats: MtpStats | None = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                loss_normalizer: float | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        decoder = self.decoder
        h = decoder(input_ids, position_ids, segment_ids)
        if logits_to_keep > 0 and labels is None:
            assert not getattr(self, "sequence_parallel", False), "a sequence shard has no 'last positions'"
            h = h[:, -logits_to_keep:]
        out: torch.Tensor = self.output(self.head(h), labels, loss_normalizer)
        if labels is None or not len(self.mtp) or not self.training:
            return out
        side = decoder.block_inputs(h, input_ids.shape[1], position_ids, segment_ids)
        return mtp_loss(self.mtp, h, labels, out, embed=decoder.embedding, head=self.head, output=self.output,
                        side=side, segment_ids=segment_ids, loss_normalizer=loss_normalizer,
                        weight=self.config.mtp_loss_weight, stats=self.mtp_stats)


def hf_name(name: str, config: DecoderConfig) -> str:
    """plait's parameter or buffer name -> DeepSeek's tensor name (``mtp.K.`` -> ``model.layers.{L+K}.``;
    the router's ``expert_bias`` -> ``e_score_correction_bias``)."""
    if name.endswith(".gate.expert_bias"):
        name = name[:-len("expert_bias")] + "e_score_correction_bias"
    if name.startswith("mtp."):
        k, rest = name[len("mtp."):].split(".", 1)
        name = f"model.layers.{config.num_hidden_layers + int(k)}.{rest}"
    return name


__all__ = ["DeepseekV3Attention", "DeepseekV3DecoderLayer", "DeepseekV3ForCausalLM", "DeepseekV3Model",
           "MtpStats", "MultiTokenPrediction", "hf_name", "mtp_inputs", "mtp_loss"]
