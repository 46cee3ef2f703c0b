"""bf16 only on a GPU that has it in hardware (issue 35, item 5). torch.cuda.is_bf16_supported() - and so DeepSpeed's
CUDA accelerator's is_bf16_supported() - is True on a V100 (compute capability 7.0), which emulates bf16 without
tensor cores: a bf16 run there is several times slower and says nothing. Below 8.0 `megamemo train` refuses
precision.dtype=bf16 in one line naming the fp16 preset.

No GPU here: DeepSpeed's real CUDA accelerator is used with torch.cuda's answers faked as a V100's / A100's / H100's
(is_available, is_bf16_supported as torch gives it on each, the capability, the name)."""

from __future__ import annotations

import pytest
import torch
from helpers.fixture_data import REPO

from megamemo.config.run import ConfigError

GPUS = {
    "v100": ((7, 0), "Tesla V100-SXM2-32GB"),
    "t4": ((7, 5), "Tesla T4"),
    "a100": ((8, 0), "NVIDIA A100-SXM4-80GB"),
    "h100": ((9, 0), "NVIDIA H100 80GB HBM3"),
}


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(name): this process believes it runs on one GPU of that kind, through DeepSpeed's CUDA accelerator."""
    import deepspeed.accelerator as dsa
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    def make(name: str):
        capability, device_name = GPUS[name]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # sm70: emulated
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
        acc = CUDA_Accelerator()
        assert acc.device_name() == "cuda" and acc.is_bf16_supported()  # DeepSpeed's own check lets it pass
        monkeypatch.setattr(dsa, "get_accelerator", lambda: acc)
        return acc

    return make


@pytest.mark.parametrize("gpu", ["v100", "t4"])
def test_check_precision_refuses_bf16_below_compute_capability_8(fake_gpu, gpu):
    from megamemo.train.engine import check_precision

    fake_gpu(gpu)
    with pytest.raises(ConfigError) as e:
        check_precision("bf16")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("precision.dtype: bf16 needs a GPU of compute capability 8.0"), msg
    assert GPUS[gpu][1] in msg and "{}.{}".format(*GPUS[gpu][0]) in msg, msg
    assert "fp16 preset" in msg and "launch/slurm/v100-fp16.sbatch" in msg and "precision.dtype=fp16" in msg, msg
    assert (REPO / "launch/slurm/v100-fp16.sbatch").read_text().count("MEGAMEMO_PRECISION:-fp16") == 1  # what it names
    assert check_precision("fp16") is None and check_precision("fp32") is None  # the preset passes: no capability


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_check_precision_passes_bf16_from_compute_capability_8(fake_gpu, gpu):
    from megamemo.train.engine import check_precision

    fake_gpu(gpu)
    assert check_precision("bf16") == GPUS[gpu][0] >= (8, 0)  # checked against this GPU's capability, passed


@pytest.mark.parametrize("gpu, refused", [("v100", True), ("a100", False)])
def test_train_start_up_refuses_bf16_on_a_v100(fake_gpu, monkeypatch, capsys, tmp_path, gpu, refused):
    """The call site: `megamemo train` with precision.dtype=bf16 stops with exit code 2 and the one line on a V100;
    on an A100 it goes on to build the trainer (replaced here by one that raises: nothing trains)."""
    from megamemo.commands import train as cli
    from megamemo.runtime import device
    from megamemo.train import run

    class Built(Exception):
        pass

    def build(cfg, log=print, stop=None, **kw):
        raise Built()

    fake_gpu(gpu)
    monkeypatch.setattr(run, "build", build)
    monkeypatch.setattr(device, "resolve", lambda env=None: "cuda")
    monkeypatch.setattr("megamemo.train.run.check_data_dir", lambda cfg: None)
    monkeypatch.setattr("megamemo.train.run.die_with_parent", lambda: None)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    args = [
        "--config",
        str(REPO / "configs/tiny-cpu.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "precision.dtype=bf16",
    ]
    try:
        if refused:
            assert cli.main(args) == 2
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert len(err) == 1 and "bf16 needs a GPU of compute capability 8.0" in err[0], err
            assert "Tesla V100-SXM2-32GB is 7.0" in err[0] and "v100-fp16.sbatch" in err[0], err
        else:
            with pytest.raises(Built):
                cli.main(args)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
