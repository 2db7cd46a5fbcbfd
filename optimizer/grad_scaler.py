"""Loss scaling for fp16 (dynamic) and the identity scaler for bf16/fp32.

Owns: the current loss scale and its growth/backoff bookkeeping (Megatron semantics: halve after
`hysteresis` overflowing steps, double after `growth_interval` clean steps). It must never look
at gradients itself; the optimizer tells it whether an overflow happened.
"""
from __future__ import annotations


class ConstantScaler:
    scale = 1.0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class DynamicGradScaler:
    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0 or growth_interval < 1 or hysteresis < 1:
            raise ValueError("loss scale settings must be positive")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker),
                "hysteresis_tracker": int(self.hysteresis_tracker)}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            self.scale = float(sd["scale"])
            self.growth_tracker = int(sd["growth_tracker"])
            self.hysteresis_tracker = int(sd["hysteresis_tracker"])
