"""The prompt stream the trainer draws from: :class:`PromptDataset` holds the loaded prompts in file order
and hands out batches in a per-epoch shuffle that is a pure function of ``(seed, epoch)``, so its position
is three integers (:meth:`PromptDataset.state_dict`) and a resumed run continues with exactly the prompts
it would have seen."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, overload

from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.stats import DatasetStats
from dapo_megatron.records import PromptExample

__all__ = ["PromptDataset"]


class PromptDataset(Sequence[PromptExample]):
    """Prompts in file order (indexing, ``take``) plus a resumable, per-epoch shuffled batch stream.

    Position = ``(epoch, index)``: ``index`` prompts of epoch ``epoch``'s order were handed out.
    ``next_batch`` drops an epoch's tail that is shorter than the batch and starts the next epoch,
    like a drop-last data loader; reshuffling makes a different tail wait each epoch.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        *,
        shuffle: bool = True,
        seed: int = 0,
        stats: DatasetStats | None = None,
    ) -> None:
        if not examples:
            detail = f" ({stats.summary()})" if stats else ""
            raise DatasetError(
                f"the data set is empty after loading{detail}. Fix: check the files, the "
                "length limit and data.overlong_prompt."
            )
        self._examples = tuple(examples)
        self.shuffle = shuffle
        self.seed = seed
        self.stats = stats or DatasetStats(final_size=len(self._examples))
        self._epoch, self._index, self._order = 0, 0, self.epoch_order(0)

    def __len__(self) -> int:
        return len(self._examples)

    @overload
    def __getitem__(self, index: int) -> PromptExample: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[PromptExample]: ...
    def __getitem__(self, index: int | slice) -> PromptExample | Sequence[PromptExample]:
        return self._examples[index]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def index(self) -> int:
        return self._index

    @property
    def remaining_in_epoch(self) -> int:
        """Prompts of the current epoch not handed out yet."""
        return len(self) - self._index

    def take(self, n: int) -> list[PromptExample]:
        """The first ``n`` prompts in file order (all of them if there are fewer), for evaluation."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0; got {n}")
        return list(self._examples[:n])

    def batches_per_epoch(self, batch_size: int) -> int:
        return len(self) // batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of ``epoch``'s order. Sorting by a keyed hash makes the order a pure function of
        ``(seed, epoch, size)`` that no library upgrade can change, unlike a seeded RNG stream: a
        run resumed in a newer environment still sees the prompts it would have seen."""
        if not self.shuffle:
            return list(range(len(self)))
        salt = f"{self.seed}:{epoch}:".encode()

        def rank(i: int) -> bytes:
            return hashlib.blake2b(salt + str(i).encode(), digest_size=8).digest()

        return sorted(range(len(self)), key=rank)

    def next_batch(self, batch_size: int) -> list[PromptExample]:
        """The next ``batch_size`` prompts, moving to a fresh epoch when this one has too few left."""
        if not 1 <= batch_size <= len(self):
            raise ValueError(f"batch_size must be in [1, {len(self)}] (the data set size); got {batch_size}")
        if self.remaining_in_epoch < batch_size:
            self._start_epoch(self._epoch + 1, index=0)
        chosen = self._order[self._index : self._index + batch_size]
        self._index += batch_size
        return [self._examples[i] for i in chosen]

    def _start_epoch(self, epoch: int, *, index: int) -> None:
        if epoch != self._epoch:
            self._order = self.epoch_order(epoch)
        self._epoch, self._index = epoch, index

    def fingerprint(self) -> str:
        """Hash of the prompt uids in file order: equal exactly when a resumed run has the same data."""
        digest = hashlib.sha1("\n".join(e.uid for e in self._examples).encode("utf-8"))
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """The position (plus what must match to resume it), as plain JSON-able values."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "size": len(self),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            DatasetError: if the saved position belongs to other data, another seed or shuffle
                setting (its position would then point at different prompts).
        """
        missing = {"epoch", "index", "seed", "shuffle", "size", "fingerprint"} - set(state)
        if missing:
            raise DatasetError(f"data set state is missing {sorted(missing)}; was it saved by PromptDataset?")
        current = self.state_dict()
        for key in ("size", "fingerprint", "seed", "shuffle"):
            if state[key] != current[key]:
                raise DatasetError(
                    f"cannot resume the data set: the checkpoint has {key}={state[key]!r} but "
                    f"this run has {current[key]!r}. Fix: resume with the same data files, "
                    "length limit, de-duplication and data.seed/shuffle, or start a new run."
                )
        epoch, index = state["epoch"], state["index"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int) and 0 <= index <= len(self)):
            raise DatasetError(f"invalid data set position epoch={epoch!r}, index={index!r}")
        self._start_epoch(epoch, index=index)
