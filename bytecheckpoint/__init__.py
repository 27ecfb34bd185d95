"""bytecheckpoint: parallelism-agnostic checkpoints for PyTorch training.

    import bytecheckpoint as bcp
    bcp.save("ckpt/step_100", {"model": model, "optimizer": optim}, step=100)
    bcp.load("ckpt", {"model": model, "optimizer": optim})  # latest, resharded to this layout
"""

__version__ = "0.1.0"

from .api import load, pipeline_fqn_map, save  # noqa: E402
from .engine.async_save import SaveHandle  # noqa: E402
from .engine.load import LoadResult  # noqa: E402
from .engine.save import SaveResult  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointReplacedError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    DtypeMismatchError,
    InvalidArgumentError,
    MissingKeysError,
    NotACheckpointError,
    RankFailedError,
    ShapeMismatchError,
    StagingError,
    StateMismatchError,
    StorageError,
    StorageIOError,
    UnsafeCheckpointError,
)
from .extra import RNGState  # noqa: E402
from .integrity import verify  # noqa: E402
from .shards import TensorShard  # noqa: E402

__all__ = [
    "save", "load", "verify", "pipeline_fqn_map", "TensorShard", "RNGState", "SaveResult", "SaveHandle",
    "LoadResult",
    "CheckpointError",
    "CheckpointExistsError", "CorruptCheckpointError", "DtypeMismatchError", "MissingKeysError",
    "NotACheckpointError", "RankFailedError", "ShapeMismatchError", "StateMismatchError",
    "UnsafeCheckpointError", "CheckpointReplacedError", "ConcurrentSaveError", "InvalidArgumentError",
    "StorageError", "StorageIOError", "StagingError",
]
