"""What the image build borrows from the host: apt's Debian mirror, and pip's configuration.

Both are read from the tools themselves (``apt-get indextargets``, ``pip config
list``), so every format and override they accept is honoured; the functions
here only pick and translate.
"""

from __future__ import annotations

import ast
import configparser
import io
import ssl
from dataclasses import dataclass
from pathlib import Path

# apt-get indextargets --format: one line per index target apt would download.
INDEXTARGETS_FORMAT = "$(REPO_URI) $(RELEASE) $(COMPONENT) $(TARGET_OF) $(IDENTIFIER)"


def debian_mirror(indextargets: str, suite: str) -> str:
    """The first configured Debian mirror carrying ``suite``'s main packages.

    ``indextargets`` is ``apt-get indextargets --format INDEXTARGETS_FORMAT``'s output.

    Raises:
        LookupError: no ``deb`` source of ``suite``/main is configured.
    """
    for line in indextargets.splitlines():
        fields = line.split()
        if len(fields) != 5:
            continue
        uri, release, component, target_of, identifier = fields
        if (release, component, target_of, identifier) == (suite, "main", "deb", "Packages"):
            return uri
    raise LookupError(
        f"no Debian {suite} main source among apt's sources (/etc/apt/sources.list*, "
        "apt-get indextargets); pass --mirror URL"
    )


@dataclass(frozen=True)
class PipForBuild:
    """The host's pip configuration as a file for the build, and the host paths it names."""

    config: str
    """An ini file for ``/etc/pip.conf`` in the build: the host's settings, environment included."""
    paths: tuple[Path, ...]
    """Host files and folders the settings name (CA bundle, constraints, local indexes), to
    mount read-only at the same paths."""


def pip_for_build(config_list: str, default_cert: Path | None = None) -> PipForBuild:
    """Translate ``pip config list``'s output into a pip.conf and the paths it needs.

    ``pip config list`` prints ``section.key='value'`` lines from every configuration
    file pip reads, and ``:env:.key`` for the ``PIP_*`` environment variables (these win,
    as they do for pip). A ``file://`` index is mounted from its parent folder (a
    PEP 503 ``simple/`` tree usually links its files as ``../../files/...``). When no
    ``cert`` is set, ``default_cert`` (the host's CA bundle) becomes it.

    Raises:
        ValueError: a line of ``config_list`` is not ``name=value`` with a quoted value,
            or a setting names a folder too wide to mount (``/``, ``/etc``, ``/opt``).
    """
    sections: dict[str, dict[str, str]] = {}
    from_env: dict[str, str] = {}
    for line in config_list.splitlines():
        if not line.strip():
            continue
        name, sep, quoted = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot:
            raise ValueError(f"pip config list: not section.key='value': {line!r}")
        try:
            value = ast.literal_eval(quoted)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"pip config list: {name}: unreadable value {quoted!r}") from exc
        if section == ":env:":
            from_env[key] = str(value)
        else:
            sections.setdefault(section, {})[key] = str(value)
    sections.setdefault("global", {}).update(from_env)
    settings = sections["global"]
    if "cert" not in settings and default_cert is not None and default_cert.is_file():
        settings["cert"] = str(default_cert)

    paths: list[Path] = []
    for values in sections.values():
        for value in values.values():
            for word in value.split():
                path = _local_path(word)
                if path is not None and path.exists() and path not in paths:
                    if path.is_dir() and len(path.parts) < 3:  # "/", "/etc", "/opt": never
                        raise ValueError(f"pip config list names {path}: too wide to mount")
                    paths.append(path)
    parser = configparser.ConfigParser(interpolation=None)
    for section, values in sections.items():
        parser[section] = values
    text = io.StringIO()
    parser.write(text)
    return PipForBuild(text.getvalue(), _outermost(paths))


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's OpenSSL uses by default, when it is a file."""
    cafile = ssl.get_default_verify_paths().cafile
    if cafile and Path(cafile).is_file():
        return Path(cafile)
    debian = Path("/etc/ssl/certs/ca-certificates.crt")
    return debian if debian.is_file() else None


def _local_path(word: str) -> Path | None:
    """The host path a setting's word names: a ``file://`` index's root, an absolute path."""
    if word.startswith("file://"):
        index = Path(word.removeprefix("file://")).resolve()
        return index.parent if index.parent != index.parent.parent else index
    if word.startswith("/"):
        return Path(word)
    return None


def _outermost(paths: list[Path]) -> tuple[Path, ...]:
    """``paths`` without those inside another one (one mount covers them)."""
    return tuple(p for p in paths if not any(o != p and p.is_relative_to(o) for o in paths))
