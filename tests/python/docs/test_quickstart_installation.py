"""The original's installation page (docs/UserGuide/QuickStart/installation.en.md):
`pip install roundpipe` installs the distribution "roundpipe" that provides
the package; `pip install -e .` in a checkout builds that same project;
requirements Python >= 3.8 and PyTorch >= 2.4; "if PyTorch can access your
GPU, RoundPipe will work"."""
import importlib.metadata
import os
import sys

import pytest
import roundpipe
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_the_distribution_roundpipe_provides_the_package():
    dist = importlib.metadata.distribution("roundpipe")
    assert dist.metadata["Name"] == "roundpipe"
    assert dist.version == roundpipe.__version__
    assert {"RoundPipe", "wrap_model_to_roundpipe", "GradScaler", "optim"} <= set(dir(roundpipe))


def test_the_checkout_is_the_project_pip_install_e_builds():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == "roundpipe"
    assert project["version"] == roundpipe.__version__


def test_the_running_environment_meets_the_requirements():
    assert sys.version_info >= (3, 8)
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 4)
    requirements = pytest.importorskip("packaging.requirements")
    torch_requirement = [requirements.Requirement(r) for r in importlib.metadata.requires("roundpipe")
                         if requirements.Requirement(r).name == "torch"][0]
    assert torch_requirement.specifier.contains("2.4.0")  # PyTorch >= 2.4 is enough to install


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_if_pytorch_can_access_the_gpu_roundpipe_runs_on_it():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = roundpipe.RoundPipe(net)
    assert model.devices and all(d.startswith("cuda") for d in model.devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), net(x), rtol=1e-5, atol=1e-5)
