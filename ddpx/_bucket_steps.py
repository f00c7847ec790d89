"""register_fused_hook(optimizer=...): the optimizer steps each gradient bucket's parameters as
soon as that bucket is reduced, while backward and the other buckets' communication go on; the
loop's own ``optimizer.step()`` then steps only what no bucket did."""

import torch

__all__ = ["BucketSteps", "checked_optimizer"]


def checked_optimizer(optimizer, device: str) -> torch.optim.Optimizer:
    """The torch optimizer to step per bucket (Accelerate's wrapper unwrapped), or a ValueError
    that says why this one cannot be."""
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ddpx: optimizer= takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS) or name == "ZeroRedundancyOptimizer":
        raise ValueError(f"ddpx: {name} cannot step a bucket's parameters alone (its step needs "
                         "every gradient, or every rank): register the hook without optimizer= "
                         "and call optimizer.step() after backward")
    if device != "cpu":
        raise ValueError(f"ddpx: optimizer= steps CPU buckets; these are on {device}: register "
                         "the hook without optimizer= and call optimizer.step() after backward")
    return optimizer


class BucketSteps:
    """Called with a reduced bucket's gradients (views of the bucket) and its parameters, on a
    thread of ddpx's while the autograd thread is still in backward: steps the optimizer on those
    of the parameters it has, each with that gradient, and marks them stepped. The loop's
    ``optimizer.step()`` leaves the stepped parameters out (their .grad hidden from it, and put
    back after), so a loop written for a plain optimizer runs unchanged."""

    __slots__ = ("_optimizer", "_stepping", "_stepped", "_hidden")

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer
        self._stepping = False
        self._stepped: list[torch.nn.Parameter] = []
        self._hidden: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._before_loop_step)
        optimizer.register_step_post_hook(self._after_loop_step)

    def __call__(self, gradients: list[torch.Tensor], parameters: list[torch.Tensor]) -> None:
        groups = self._optimizer.param_groups
        group_of = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
        # A parameter without a gradient (unused in this backward) is left to the loop's step,
        # which leaves it alone too.
        mine = [(p, g) for p, g in zip(parameters, gradients, strict=True)
                if id(p) in group_of and p.grad is not None]
        if not mine:
            return
        kept = [group["params"] for group in groups]
        held = [(p, p.grad) for p, _ in mine]
        try:
            for index, group in enumerate(groups):
                group["params"] = [p for p, _ in mine if group_of[id(p)] == index]
            for p, gradient in mine:
                p.grad = gradient
            self._stepping = True
            self._optimizer.step()
        finally:
            self._stepping = False
            for group, params in zip(groups, kept, strict=True):
                group["params"] = params
            for p, grad in held:
                p.grad = grad
        self._stepped.extend(p for p, _ in held)

    def _before_loop_step(self, optimizer, args, kwargs) -> None:
        if self._stepping:
            return
        self._hidden = [(p, p.grad) for p in self._stepped if p.grad is not None]
        for p, _ in self._hidden:
            p.grad = None

    def _after_loop_step(self, optimizer, args, kwargs) -> None:
        if self._stepping:
            return
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden, self._stepped = [], []
