"""A shard's optimizer over its flat slice, with every element stepped on the fused kernel's vector path.

Why: torch's fused CPU optimizers step a tensor in SIMD vectors and finish its last ``numel % width``
elements in a scalar loop whose rounding differs (no FMA) -- 1 ulp, now and then.  Which elements fall in
that tail depends on where the slice ends, so the same job on 2 and on 3 shards (a re-shard,
psserver.resharding.reshard) would differ in a few elements per step.  Here the slice is stepped as two tensors in one
fused call: its body (a view of the parameters, a whole number of LANE_PAD-element units) and its tail
copied into a LANE_PAD-element buffer padded with zeros (a zero parameter with a zero gradient stays zero
under SGD, Adam and AdamW).  Every element then takes the vector path whatever the layout, and the job's
parameters are a function of the global element alone.

``state_dict`` / ``load_state_dict`` speak the one-tensor format of a plain torch optimizer over the slice
(what checkpoints hold), so checkpoints written before this change restore, and re-cutting them is slicing.
"""

from __future__ import annotations

import torch

from psserver.protocol.job import OptimizerConfig
from psserver.protocol.optim import build_optimizer
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

LANE_PAD = 64  # elements: a multiple of every float SIMD width torch's CPU kernels use (8 with AVX2, 16 AVX-512)


class SliceOptimizer:
    def __init__(self, cfg: OptimizerConfig, params: torch.nn.Parameter):
        self.params = params
        n = params.numel()
        self.split, self.rest = n - n % LANE_PAD, n % LANE_PAD
        self.body = torch.nn.Parameter(params.detach()[: self.split], requires_grad=False)
        self.tail = torch.nn.Parameter(torch.zeros(LANE_PAD if self.rest else 0), requires_grad=False)
        self._tail_grad = torch.zeros_like(self.tail)
        self.inner = build_optimizer(cfg, [self.body, self.tail], fused=True)
        self.direct = True  # steps after the first call torch's functional step itself (``_direct_step``)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def rebind(self) -> None:
        """The parameters moved to other memory (copy on write for a pull): the body views the new memory."""
        self.body.data = self.params.detach()[: self.split]

    def step(self, grad: torch.Tensor) -> None:
        """One step of the slice with ``grad`` (slice-sized)."""
        p = self.params.detach()
        self.tail.detach()[: self.rest].copy_(p[self.split:])
        self._tail_grad[: self.rest].copy_(grad[self.split:])
        self.body.grad, self.tail.grad = grad[: self.split], self._tail_grad
        try:
            if not (self.direct and self._direct_step()):
                self.inner.step()
        finally:
            self.body.grad = self.tail.grad = None
        p[self.split:].copy_(self.tail.detach()[: self.rest])

    def _direct_step(self) -> bool:
        """The step ``inner.step()`` takes, made by calling the torch.optim functional it calls (``sgd``, ``adam``)
        with the same arguments -- the same fused kernel on the same tensors, so bit for bit the same -- without
        the wrapper's per-call work (profiling hooks, grad mode, the groups' lists rebuilt: ~0.1 ms, most of a
        small slice's step).  False -- nothing done -- unless the optimizer's state is all there (after its first
        step), for ``inner.step()`` to make it.  tests/unit/test_slice_optim.py compares the two step by step."""
        inner = self.inner
        if len(inner.param_groups) != 1 or getattr(inner, "grad_scale", None) is not None or \
                getattr(inner, "found_inf", None) is not None:
            return False
        group, params = inner.param_groups[0], [self.body, self.tail]
        states = [inner.state.get(q, {}) for q in params]
        grads = [self.body.grad, self.tail.grad]
        with torch.no_grad():
            if isinstance(inner, torch.optim.SGD):
                if group["momentum"] != 0 and any(s.get("momentum_buffer") is None for s in states):
                    return False
                _sgd(params, grads, [s.get("momentum_buffer") for s in states] if group["momentum"] != 0 else [],
                     weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                     dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                     has_sparse_grad=False, foreach=group["foreach"], fused=group["fused"])
                return True
            if not isinstance(inner, torch.optim.Adam):  # (AdamW is an Adam)
                return False
            keys = ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            if any(k not in s for s in states for k in keys):
                return False
            beta1, beta2 = group["betas"]
            _adam(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                  [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [], [s["step"] for s in states],
                  amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                  foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                  fused=group["fused"], decoupled_weight_decay=group["decoupled_weight_decay"])
        return True

    def slice_sized_states(self) -> int:
        """How many slice-sized tensors the optimizer keeps (Adam's two moments: 2; none before its first step)."""
        return sum(1 for t in self.inner.state.get(self.body, {}).values() if torch.is_tensor(t) and t.dim() > 0)

    # ------------------------------------------------------------------ the one-tensor format
    def state_dict(self) -> dict:
        states = [self.inner.state.get(p, {}) for p in (self.body, self.tail)]
        merged = {}
        for key, body in states[0].items():
            tail = states[1].get(key)
            if torch.is_tensor(body) and body.dim() > 0:
                merged[key] = torch.cat([body, tail[: self.rest]])
            else:
                merged[key] = body.clone() if torch.is_tensor(body) else body
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [0]} for g in self.inner.param_groups]
        return {"state": {0: merged} if merged else {}, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        one = saved["state"].get(0, {})
        body, tail = {}, {}
        for key, value in one.items():
            if torch.is_tensor(value) and value.dim() > 0:
                body[key] = value[: self.split].clone()
                tail[key] = torch.cat([value[self.split:], value.new_zeros(LANE_PAD - self.rest)]) if self.rest \
                    else value.new_zeros(0)
            else:
                # One copy each: a fused step counts each parameter's step tensor in place.
                body[key], tail[key] = ((value.clone(), value.clone()) if torch.is_tensor(value) else (value, value))
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [0, 1]} for g in saved["param_groups"]]
        self.inner.load_state_dict({"state": {0: body, 1: tail} if one else {}, "param_groups": groups})

    def state_items(self):
        """(name, value) of the one-tensor state, in a stable order: what a state digest hashes."""
        return sorted(self.state_dict()["state"].get(0, {}).items())
