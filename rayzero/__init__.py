"""rayzero: elastic distributed training for PyTorch on Ray, with ZeRO stages 0-3."""

from rayzero.config import Config, ConfigError, NotSupportedYetError
from rayzero.engine import Engine, NonFiniteGradientError, initialize
from rayzero.train.cluster_config import ClusterConfig
from rayzero.train.fit import Result, fit
from rayzero.zero.init import zero_init

__all__ = [
    "ClusterConfig",
    "Config",
    "ConfigError",
    "Engine",
    "NonFiniteGradientError",
    "NotSupportedYetError",
    "Result",
    "fit",
    "initialize",
    "zero_init",
]
__version__ = "0.1.0"
