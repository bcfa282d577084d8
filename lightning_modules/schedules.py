"""Learning-rate schedules from the papers, as ``torch.optim.lr_scheduler`` classes usable from YAML.

LightningCLI builds ``lr_scheduler: {class_path: ..., init_args: ...}`` with the optimizer as first argument and steps
it once per epoch, which is the granularity of these schedules.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class ZarembaDecay(LambdaLR):
    """Constant for ``constant_epochs`` epochs, then multiplied by ``decay`` every epoch (Zaremba et al. 2014).

    The learning rate of 0-based epoch ``e`` is ``lr * decay ** max(e + 1 - constant_epochs, 0)``: the "max-epoch"
    schedule that Jozefowicz et al. 2015 §3.6 also use for PTB (max-epoch in {4, 7, 11}, decay in {0.5, 0.65, 0.8}).

    Args:
        optimizer: the optimizer.
        constant_epochs: epochs at the initial learning rate ("max_epoch" in Zaremba's code).
        decay: factor per epoch after that.
        last_epoch: for resuming.
    """

    def __init__(
        self, optimizer: Optimizer, constant_epochs: int = 4, decay: float = 0.5, last_epoch: int = -1
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.constant_epochs = constant_epochs
        self.decay = decay
        super().__init__(optimizer, self._factor, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.decay ** max(epoch + 1 - self.constant_epochs, 0)
