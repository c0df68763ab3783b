"""`mcore-rl serve MODEL`: vLLM's OpenAI-compatible server on what this system trained.

MODEL is an HF folder (a run's `hf/step_N` export) or an mcore_rl weights checkpoint, which is
converted into a temporary HF folder first (removed at exit). Every vLLM `serve` flag passes
through unchanged (`--port`, `--api-key`, `--tensor-parallel-size`, `--max-model-len`...); two
defaults differ from vLLM's: the server binds 127.0.0.1 unless `--host` says otherwise (a
checkpoint is not published to the network by accident), and the model is served under the
name MODEL was given as, so clients use the string the operator typed.
"""

from __future__ import annotations

import os
import tempfile
from importlib.metadata import entry_points

from ..checkpoint.weights_io import METADATA_FILE, is_checkpoint
from .generate_route import GenerateEndpoint

DEFAULT_HOST = "127.0.0.1"


def servable_folder(model: str, scratch: str) -> str:
    """MODEL as an HF folder vLLM loads: an HF folder as it is, a weights checkpoint
    converted into `scratch`."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    if is_checkpoint(model):
        from ..conversion.mcore_to_hf import convert_mcore_to_hf
        from ..runtime import print0, shutdown, start_process_group

        start_process_group()
        folder = os.path.join(scratch, "hf")
        convert_mcore_to_hf(model, folder)
        shutdown()
        print0(f"serve: converted {model} into {folder} (removed at exit)")
        return folder
    raise FileNotFoundError(
        f"serve: {model} is neither an HF model folder (no config.json) nor an mcore_rl weights "
        f"checkpoint (no {METADATA_FILE}); a run's exports are under RUN_DIR/hf/step_N")


def vllm_arguments(folder: str, model: str, passthrough: list[str], max_body_bytes: int):
    """vLLM's own parsed and validated serve arguments, with this command's defaults."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", folder, *passthrough]
    given = {flag.split("=")[0] for flag in passthrough if flag.startswith("--")}
    if "--host" not in given:
        argv += ["--host", DEFAULT_HOST]
    if "--served-model-name" not in given:
        argv += ["--served-model-name", model]
    args = make_arg_parser(FlexibleArgumentParser(prog="mcore-rl serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    args.max_body_bytes = max_body_bytes
    return args


def allow_generate_plugin() -> None:
    """Allow-list the /generate endpoint plugin in VLLM_PLUGINS. vLLM loads endpoint plugins
    only when named there, and the variable allow-lists every other plugin group too: when it
    is unset, every installed vLLM plugin is named so none stops loading."""
    names = os.environ.get("VLLM_PLUGINS")
    if names is None:
        installed = entry_points()
        names = ",".join(entry.name for group in installed.groups if group.startswith("vllm.")
                         and group != "vllm.endpoint_plugins"
                         for entry in installed.select(group=group))
    listed = [name for name in names.split(",") if name]
    if GenerateEndpoint.name not in listed:
        os.environ["VLLM_PLUGINS"] = ",".join([*listed, GenerateEndpoint.name])


def serve(model: str, passthrough: list[str], max_body_bytes: int) -> None:
    """Serve until SIGINT/SIGTERM (vLLM's graceful shutdown), then remove any conversion."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    with tempfile.TemporaryDirectory(prefix="mcore_rl_serve_") as scratch:
        folder = servable_folder(model, scratch)
        cli_env_setup()
        allow_generate_plugin()
        uvloop.run(run_server(vllm_arguments(folder, model, passthrough, max_body_bytes)))
