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
    aux_loss_scope: Literal["micro_batch"] = Field(
        default="micro_batch", description="Tokens the load-balancing statistics are taken over: each "
                                           "micro-batch of each rank (Hugging Face, Megatron's default); a "
                                           "global-batch scope is not available yet")
    z_loss_coef: Float = Field(default=0.0, ge=0, description="Weight of the router z-loss (ST-MoE), averaged "
                                                              "over MoE layers; 0 = off")
    capacity_factor: Float | None = Field(
        default=None, description="Assignments an expert accepts per micro-batch, as a multiple of the "
                                  "balanced share (tokens * top_k / experts); the lowest-weight ones over it are "
                                  "dropped; null = dropless")

    def changed(self) -> list[str]:
        """The fields whose value differs from the default (a dumped recipe sets every field)."""
        default = MoeSection()
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(default, name)]
