"""FSDP for the trainer, and full (unsharded) checkpoints whatever wrote them.

`draftsmith train --fsdp` under torchrun shards the drafter with PyTorch's FSDP2 (`fully_shard`): parameters,
gradients and optimiser states live 1/world on each rank and are gathered only while their unit runs. For EAGLE-3
each of the embedding (frozen, usually the largest tensor), `fc`, the decoder layer, the norm and the draft head is
a unit of its own. FSDP2 hooks module `forward`s, and the losses call the drafter's modules and methods directly, so
the root FSDP module is `ShardedLoss`, whose forward *is* the objective's loss: every unit's all-gather and
reduce-scatter then happen inside one root forward/backward, as FSDP requires. A DFlash drafter is one unit, the
root: its layers' context keys/values come from a method, not a `forward`, and its loss reads the frozen head's
rows directly, which only a unit gathered for the whole forward allows. Gradients are summed, not averaged, over
ranks (divide factor 1), because each micro-batch loss is already divided by the global batch's token count (see
trainer.py).

Checkpoints hold full tensors in the layout of a one-process run (model weights as `save_checkpoint` writes them,
`optimizer.state_dict()` with positional parameter ids): `full_*` gather them (collectives: every rank calls,
rank 0 writes) and `load_*` scatter them back into whatever layout this run uses. So a checkpoint written by 2
FSDP ranks resumes on 1 process, on 8 DDP ranks, or the other way round.

Works with NCCL on GPUs and with gloo on CPUs (tested: 2 CPU processes, see tests/test_distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from draftsmith.drafters.dflash import DFlashModel
from draftsmith.drafters.eagle3 import Eagle3Model
from draftsmith.train.losses import DFlashObjective, TTTObjective
from draftsmith.train.metrics import StepStats


class ShardedLoss(nn.Module):
    """The root FSDP module: its forward is the objective's loss of one micro-batch."""

    def __init__(
        self, model: Eagle3Model | DFlashModel, target_head: torch.Tensor, objective: TTTObjective | DFlashObjective
    ) -> None:
        super().__init__()
        self.model = model
        self.head = target_head  # a plain attribute: the frozen target head is neither sharded nor checkpointed
        self.objective = objective

    def forward(self, batch: dict[str, torch.Tensor], denominators: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
        return self.objective(self.model, batch, self.head, denominators)


def shard(
    model: Eagle3Model | DFlashModel, target_head: torch.Tensor, objective: TTTObjective | DFlashObjective
) -> ShardedLoss:
    """Shard `model` in place over all ranks of the default process group; returns the root to call for the loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = target_head.device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if isinstance(model, Eagle3Model):
        for unit in (model.embed_tokens, model.fc, model.midlayer, model.norm, model.lm_head):
            fully_shard(unit, mesh=mesh)
    root = fully_shard(ShardedLoss(model, target_head, objective), mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over ranks: the losses are already global means
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return root


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded tensor gathered, on the CPU (a collective under FSDP)."""
    return {k: _full(v).detach().cpu() for k, v in module.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with every sharded state tensor gathered (a collective under FSDP)."""
    state = optimizer.state_dict()
    state["state"] = {
        i: {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state["state"].items()
    }
    return state


def load_model_state(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load full tensors into `module`, scattering each to the layout of the parameter it replaces."""
    current = module.state_dict()
    module.load_state_dict({k: _like(full[k], ref) for k, ref in current.items()})


def load_optimizer_state(optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Load a full `optimizer.state_dict()`, scattering each per-parameter tensor like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = dict(full)
    state["state"] = {
        i: {k: _like(v, params[int(i)]) if _per_param(v, params[int(i)]) else v for k, v in s.items()}
        for i, s in full["state"].items()
    }
    optimizer.load_state_dict(state)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _per_param(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape) and value.dim() > 0


def _like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):  # already in this run's layout (e.g. the frozen embedding, kept as it is)
        return value
    if isinstance(ref, DTensor):
        return distribute_tensor(value.to(ref.device, ref.dtype), ref.device_mesh, ref.placements)
    return value.to(ref.device)
