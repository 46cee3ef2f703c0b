"""Imported once by the fork server of tests/helpers/forked.py: what a rank of `megamemo train` would import, with the
process set up first as megamemo's command sets it up (megamemo/cli.py prepare_process) and the environment the
tests' ranks share (one thread, DeepSpeed's CPU accelerator). TorchDynamo is imported too (a ZeRO rank imports it
with DeepSpeed's Muon module, and a TP or pipeline rank with megatron-core): torch reads TORCHDYNAMO_DISABLE at each
compile call, so a rank that compiles still lifts it for itself."""

import os

from helpers.forked import SERVER_ENV

os.environ.update(SERVER_ENV)

from megamemo.cli import prepare_process

prepare_process()

import deepspeed  # noqa: E402
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import megatron.core.tensor_parallel  # noqa: E402,F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401

import megamemo.commands.train  # noqa: E402
import megamemo.train.build  # noqa: E402
import megamemo.train.engine  # noqa: E402
import megamemo.train.loop  # noqa: E402
import megamemo.train.run  # noqa: E402,F401
