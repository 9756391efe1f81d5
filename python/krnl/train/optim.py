"""The optimizers and the learning-rate schedule, where callers have always found them: the code
lives in krnl.train.optimizers (base.py: what every optimizer's step does on the device)."""

from .optimizers import OPTIMIZER_FIELDS, OPTIMIZERS, from_config  # noqa: F401
from .optimizers.adamw8bit import AdamW8bit  # noqa: F401
from .optimizers.base import FlatOptimizer  # noqa: F401
from .optimizers.elementwise import SGD, Adam, AdamW, Lion  # noqa: F401
from .optimizers.factored import Adafactor  # noqa: F401
from .optimizers.muon import Muon  # noqa: F401
from .optimizers.schedule import LossScaler, Schedule  # noqa: F401
