"""fp16 loss scaling: static, or dynamic with hysteresis (DeepSpeed-compatible semantics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    """Keeps the fp16 loss scale.

    Dynamic mode: an overflow consumes one unit of ``hysteresis``; when none is left the scale is divided
    by ``scale_factor`` (never below ``min_scale``) and the step is skipped.  After ``window`` steps without
    overflow the scale is multiplied by ``scale_factor`` on the next good step (DeepSpeed's count).  Static
    mode (``dynamic=False``) never changes the scale; an overflow still skips the step.  Unlike DeepSpeed,
    an overflow at ``min_scale`` skips the step again instead of ending the run.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    scale_factor: float = 2.0
    good_steps: int = 0
    hysteresis_left: int = 2
    overflows: int = 0

    @classmethod
    def from_fp16_config(cls, fp16) -> "LossScaler":
        if not fp16.enabled:
            return cls(scale=1.0, dynamic=False)
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale), dynamic=False)
        return cls(
            scale=float(2 ** fp16.initial_scale_power),
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=float(fp16.min_loss_scale),
            hysteresis_left=fp16.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.good_steps += 1
        # as DeepSpeed: the scale grows on the good step after each `window` good steps since the last
        # overflow (or the start): steps window + 1, 2 * window + 1, ... of the run without overflow
        if self.good_steps > 1 and (self.good_steps - 1) % self.window == 0:
            self.scale *= self.scale_factor
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
