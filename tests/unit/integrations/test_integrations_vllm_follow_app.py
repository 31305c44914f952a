"""The API server's side of a following vLLM replica (``preheat.integrations.vllm.follow_app``): its warnings reach
the replica's log even where vLLM's SageMaker bootstrap has set the root logger to ERROR."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from preheat.integrations.vllm.follow_app import _keep_warnings


@pytest.fixture
def root_at_error() -> Iterator[None]:
    """The root logger as ``model_hosting_container_standards`` leaves it in ``vllm serve`` (LOG_LEVEL unset)."""
    root, ours = logging.getLogger(), logging.getLogger("preheat")
    levels = root.level, ours.level
    root.setLevel(logging.ERROR)
    ours.setLevel(logging.NOTSET)
    try:
        yield
    finally:
        root.setLevel(levels[0])
        ours.setLevel(levels[1])


def test_refit_warnings_are_kept_when_the_root_logger_drops_them(root_at_error: None) -> None:
    refit = logging.getLogger("preheat.refit")
    assert not refit.isEnabledFor(logging.WARNING)  # what a following vLLM replica did: its failures unseen
    _keep_warnings()
    assert refit.isEnabledFor(logging.WARNING)
    assert not refit.isEnabledFor(logging.INFO)  # quiet by default: warnings, not the story


def test_a_level_the_operator_set_is_left_as_it_is(root_at_error: None) -> None:
    logging.getLogger("preheat").setLevel(logging.INFO)
    _keep_warnings()
    assert logging.getLogger("preheat").level == logging.INFO
