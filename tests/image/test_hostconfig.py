"""What `make image-test` borrows from the host: apt's mirror, pip's configuration (no root)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from tests.image.hostconfig import debian_mirror, pip_for_build

INDEXTARGETS = """\
http://deb.example.org/debian-security/ bookworm-security main deb Packages
http://deb.example.org/debian/ bookworm contrib deb Packages
http://src.example.org/debian/ bookworm main deb-src Sources
http://deb.example.org/debian/ bookworm main deb Translations
http://deb.example.org/debian/ bookworm main deb Packages
http://deb.example.org/debian/ bookworm-updates main deb Packages
"""


def test_mirror_is_the_first_deb_source_of_the_suites_main_packages():
    assert debian_mirror(INDEXTARGETS, "bookworm") == "http://deb.example.org/debian/"


def test_no_mirror_for_the_suite_is_an_error_saying_what_to_pass():
    with pytest.raises(LookupError, match=r"no Debian trixie main source.*--mirror"):
        debian_mirror(INDEXTARGETS, "trixie")


def read(config: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(config)
    return parser


def test_environment_wins_and_files_and_local_indexes_are_mounted(tmp_path: Path):
    cert, wheels = tmp_path / "ca.pem", tmp_path / "wheels"
    cert.write_text("stand-in")
    wheels.mkdir()
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    listing = "\n".join(
        [
            "global.timeout='60'",
            f"global.extra-index-url='file://{tmp_path}/pypi/simple https://example.org/simple'",
            f"global.find-links='{wheels}'",
            "install.no-compile='true'",
            ":env:.timeout='180'",
            f":env:.cert='{cert}'",
        ]
    )
    pip = pip_for_build(listing)
    parsed = read(pip.config)
    assert parsed["global"]["timeout"] == "180"  # PIP_TIMEOUT over the file, as pip does
    assert parsed["global"]["cert"] == str(cert)
    assert parsed["install"]["no-compile"] == "true"
    # The index's parent: a simple/ tree links its files as ../../files/...
    assert set(pip.paths) == {cert, wheels, tmp_path / "pypi"}


def test_host_ca_bundle_is_the_cert_when_none_is_set(tmp_path: Path):
    bundle = tmp_path / "bundle.crt"
    bundle.write_text("stand-in")
    pip = pip_for_build("global.timeout='60'", default_cert=bundle)
    assert read(pip.config)["global"]["cert"] == str(bundle)
    assert pip.paths == (bundle,)


def test_a_path_inside_another_is_mounted_once(tmp_path: Path):
    inner = tmp_path / "wheels" / "extra"
    inner.mkdir(parents=True)
    pip = pip_for_build(f"global.find-links='{tmp_path / 'wheels'} {inner}'")
    assert pip.paths == (tmp_path / "wheels",)


def test_a_top_level_folder_is_never_mounted_over_the_images():
    with pytest.raises(ValueError, match="names /etc: too wide"):
        pip_for_build("global.find-links='/etc'")


def test_an_unreadable_listing_line_is_refused_naming_it():
    with pytest.raises(ValueError, match=re.escape("not section.key='value': 'cert'")):
        pip_for_build("cert")
    with pytest.raises(ValueError, match=re.escape("global.cert: unreadable value")):
        pip_for_build("global.cert=/no/quotes")
