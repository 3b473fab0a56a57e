"""The supported torch range is enforced where the passes are installed."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.torch_version import TorchVersion

import fusion_pass
from fusion_pass.install import FORWARD_HOOK, TRAINING_HOOK
from fusion_pass import versions

HOOKS = (FORWARD_HOOK, TRAINING_HOOK)


@pytest.mark.parametrize("too_old", ["2.10.0", "2.10.1+cu128", "2.9.0", "1.13.1"])
def test_install_refuses_torch_older_than_2_11_and_names_both_versions(monkeypatch, too_old):
    monkeypatch.setattr(torch, "__version__", TorchVersion(too_old))
    before = [getattr(inductor_config, hook) for hook in HOOKS]
    expected = rf"torch {re.escape(too_old)} is not supported; it needs torch >= 2\.11"
    with pytest.raises(fusion_pass.UnsupportedTorchVersion, match=expected):
        fusion_pass.install(devices=("cpu",))
    with pytest.raises(fusion_pass.UnsupportedTorchVersion, match=r"tested: 2\.11 on CUDA \(H200\); 2\.11 to 2\.15 on CPU"):
        fusion_pass.options(devices=("cpu",))
    assert [getattr(inductor_config, hook) for hook in HOOKS] == before  # nothing was installed
    assert not fusion_pass.installed()


@pytest.mark.parametrize("supported", ["2.11.0", "2.11.0+cu130", "2.11.0a0+gitabc123", "2.12.1", "2.13.0+cpu", "2.13.1", "2.14.1+cu130", "2.15.0"])
def test_supported_versions_install_silently(monkeypatch, supported):
    monkeypatch.setattr(torch, "__version__", TorchVersion(supported))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusion_pass.install(devices=("cpu",))
    assert fusion_pass.installed()


def test_newer_than_tested_warns_once(monkeypatch):
    monkeypatch.setattr(versions, "_warned", set())
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0\.dev20270101 is newer than the newest tested release \(2\.15\)"):
        versions.check_torch_version("2.16.0.dev20270101")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_torch_version("2.16.0.dev20270101")  # once per version


def test_the_running_torch_is_supported():
    versions.check_torch_version()
    assert TorchVersion(torch.__version__) >= versions.MIN_TORCH


def test_the_newest_tested_release_is_the_newest_ci_runs():
    """The warning's "newest tested" and the minimum follow what CI runs: the suite on constraints.txt's
    torch, then .ci/torch_matrix's smoke subset on each release in its table (.ci/run runs both)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".ci", "torch_matrix")) as f:
        table = re.search(r"declare -A TRITON=\(([^)]*)\)", f.read()).group(1)
    with open(os.path.join(root, "constraints.txt")) as f:
        suite = re.search(r"^torch==(\d+\.\d+)", f.read(), re.M).group(1)
    with open(os.path.join(root, ".ci", "run")) as f:
        assert "bash .ci/torch_matrix" in f.read()
    minors = sorted({*re.findall(r"\[(\d+\.\d+)\.\d+\]=", table), suite}, key=TorchVersion)
    assert minors[0] == versions.MIN_TORCH and minors[-1] == versions.NEWEST_TESTED_TORCH, minors
    assert [int(m.split(".")[1]) for m in minors] == list(range(int(minors[0].split(".")[1]),
                                                                int(minors[-1].split(".")[1]) + 1)), minors
