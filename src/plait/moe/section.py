"""The recipe's ``moe`` section: how a Mixture-of-Experts model trains (its architecture stays in
``model``, under Hugging Face's names).

Kept beside the MoE code rather than in :mod:`plait.config.schema`, which only lists it. The base
repeats the schema's ``Section`` settings (unknown keys refused, assignments re-validated) because
the schema imports this module.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Float = Annotated[float, Field(allow_inf_nan=False)]


class MoeSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    aux_loss_coef: Float | None = Field(
        default=None, ge=0, description="Weight of the Switch/Mixtral load-balancing loss, averaged over MoE layers; "
                                        "null = the model's router_aux_loss_coef (0.001 in Hugging Face's configs)")
    aux_loss_scope: Literal["micro_batch", "global_batch"] = Field(
        default="micro_batch", description="Tokens the load shares f_i of the load-balancing loss are counted "
                                           "over: micro_batch = each micro-batch of each rank (Hugging Face, "
                                           "Megatron's default); global_batch = the step's micro-batches so far "
                                           "on every data-parallel replica (Megatron's global aux loss); the "
                                           "router probabilities P_i stay the micro-batch's")
    z_loss_coef: Float = Field(default=0.0, ge=0, description="Weight of the router z-loss (ST-MoE), averaged "
                                                              "over MoE layers; 0 = off")
    router: Literal["softmax", "sigmoid"] | None = Field(
        default=None, description="softmax = softmax top-k (Mixtral, Qwen3-MoE); sigmoid = sigmoid scores with an "
                                  "expert bias moved after each step towards balanced load (DeepSeek-V3's "
                                  "auxiliary-loss-free balancing); null = the family's (softmax)")
    router_bias_update_rate: Float = Field(
        default=0.001, ge=0, description="Sigmoid router: the expert bias moves by this much per step (up for "
                                         "experts below the mean load, down above it); 0 = a fixed bias")
    router_groups: int = Field(default=1, ge=1, description="Sigmoid router: expert groups (must divide the "
                                                            "experts); 1 = no group limit")
    router_topk_groups: int = Field(default=1, ge=1, description="Sigmoid router: groups each token may choose "
                                                                 "experts from (<= router_groups)")
    capacity_factor: Float | None = Field(
        default=None, description="Assignments an expert accepts per micro-batch, as a multiple of the "
                                  "balanced share (tokens * top_k / experts); the lowest-weight ones over it are "
                                  "dropped; null = dropless")

    dispatch: Literal["static", "exact"] = Field(
        default="static", description="How tokens travel to their experts under parallel.ep > 1: static = "
                                      "equal slots of every routed row per peer (no host read in the step, "
                                      "ep x the rows on the wire); exact = only the rows routed to each peer "
                                      "(variable split sizes, one host read of the counts per MoE layer and "
                                      "forward); no effect at ep=1")

    def changed(self) -> list[str]:
        """The fields whose value differs from the default (a dumped recipe sets every field)."""
        default = MoeSection()
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(default, name)]
