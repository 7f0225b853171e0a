"""Per-object resource facts from `ptxas -v` and the SASS (HGMMA or not)."""

import re
import subprocess

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> list:
    """Entry functions with registers, shared memory, stack and spill bytes."""
    kernels, current, props_of = {}, None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(m[1], {"name": m[1]})
        elif m := _PROPS.search(line):
            props_of = m[1]
        elif (m := _FRAME.search(line)) and props_of in kernels:
            kernels[props_of].update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif (m := _USED.search(line)) and current is not None:
            smem = _SMEM.search(line)
            current.update(registers=int(m[1]), smem_bytes=int(smem[1]) if smem else 0)
    return [kernels[name] for name in sorted(kernels)]


# ptxas's performance notes about warpgroup MMAs, e.g. "(C7519) warpgroup.arrive is injected ... to
# allow use of registers in GMMA" or "(C7510) Potential Performance Loss: wgmma.mma_async
# instructions are serialized": a mainloop that draws one runs its GMMAs one at a time (a runtime
# test among the GMMAs of a k tile made every GEMM twice as slow on the H200, benchmarks/NOTES.md).
_GMMA_NOTE = re.compile(r"\((C75\d\d)\)[^\n]*(?:GMMA|wgmma|warpgroup)", re.IGNORECASE)


def gmma_notes(log: str) -> dict:
    """{ptxas note code: count} of the notes that say GMMAs lost their overlap; {} for a clean object."""
    notes = {}
    for m in _GMMA_NOTE.finditer(log):
        notes[m[1]] = notes.get(m[1], 0) + 1
    return dict(sorted(notes.items()))


def has_hgmma(cuobjdump: str | None, obj: str) -> bool | None:
    """Whether the object's SASS uses warpgroup MMA; None without a working cuobjdump (it needs
    nvdisasm beside it or on PATH): the report then says "unknown" rather than failing a build."""
    if cuobjdump is None:
        return None
    proc = subprocess.run([cuobjdump, "--dump-sass", obj], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return "HGMMA" in proc.stdout


def summarize(kernels: list) -> dict:
    return {
        "max_registers": max((k.get("registers", 0) for k in kernels), default=0),
        "spill_bytes": sum(k.get("spill_stores", 0) + k.get("spill_loads", 0) for k in kernels),
        "max_smem_bytes": max((k.get("smem_bytes", 0) for k in kernels), default=0),
    }
