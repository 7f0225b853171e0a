"""python -m codegen --arch sm90 [--list | --render-only | --build-only] [--only A,B] [-j N]
                     [--define NAME[=VALUE] ...] [--out-dir DIR] [--wheel DIR]"""

import argparse
import json
import sys
from pathlib import Path

from .build import BuildError, build, check_defines
from .configs import KERNELS
from .render import ConfigError, configs_for, render_to_disk
from .toolchain import ToolchainError
from .wheel import build_wheel


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    p.add_argument("--arch", default="sm90", choices=sorted(KERNELS), help="target architecture (default sm90)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list the configs of --arch and exit")
    mode.add_argument("--render-only", action="store_true", help="render generated/<arch>/, do not compile")
    mode.add_argument("--build-only", action="store_true", help="compile and link generated/<arch>/ as it is")
    p.add_argument("--only", help="comma-separated config names to compile and link (default: all)")
    p.add_argument("-j", "--jobs", type=int, help="parallel compiles (default: bounded by cores and RAM, at most 4)")
    p.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a macro for every compile, for development probes (e.g. MC_PROBE_NO_CONVERT); needs --out-dir")
    p.add_argument("--out-dir", help="where the library, its manifest and objects go (default build/<arch>)")
    p.add_argument("--wheel", metavar="DIR",
                   help="then pack the package and the library into a wheel in DIR (pip install it where the layer "
                        "runs: no checkout, no CUDA toolkit)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.wheel and (args.define or args.only or args.list or args.render_only):
            raise ConfigError("--wheel packs the whole library: not with --define, --only, --list or --render-only")
        if args.list:
            for cfg in configs_for(args.arch):
                print(f"{cfg.name}\t{cfg.template}\t{json.dumps(dict(cfg.params), sort_keys=True)}")
            return 0
        only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError("-j must be at least 1")
        if args.define and not args.out_dir:
            raise ConfigError("--define needs --out-dir: a probe library must not replace build/<arch>'s")
        check_defines(args.define)   # before rendering anything
        if not args.build_only:
            unknown = sorted(set(only or ()) - {cfg.name for cfg in configs_for(args.arch)})
            if unknown:
                valid = ", ".join(cfg.name for cfg in configs_for(args.arch))
                raise ConfigError(f"unknown config {', '.join(unknown)} for {args.arch}; valid: {valid}")
            changed = render_to_disk(args.arch)
            print(f"[codegen] rendered {args.arch}: {len(changed)} files changed", flush=True)
        if not args.render_only:
            library = build(args.arch, only=only, jobs=args.jobs, out_dir=Path(args.out_dir) if args.out_dir else None,
                            defines=args.define)
            if args.wheel:
                print(f"[codegen] wrote {build_wheel(args.arch, library, Path(args.wheel))}", flush=True)
        return 0
    except (ConfigError, ToolchainError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
