"""`--header` values: `$VAR`/`${VAR}` expanded where the header is built, an unset variable an
error naming the header and the variable (never sent literally), `$$` a literal `$`."""

from __future__ import annotations

import os

import pytest

from replay.errors import OptionError
from replay.protocol.headers import parse_headers

ENV = {"SECRET": "s3cret", "EMPTY": "", "A_1": "x"}


@pytest.mark.parametrize("value, expected", [
    ("Bearer $SECRET", "Bearer s3cret"),
    ("Bearer ${SECRET}", "Bearer s3cret"),
    ("${SECRET}suffix", "s3cretsuffix"),
    ("$A_1-$A_1", "x-x"),
    ("$EMPTY", ""),  # set, though empty: sent as set
    ("pa$$word", "pa$word"),  # $$ is a literal $
    ("$$SECRET", "$SECRET"),  # ... and never starts a variable (os.path.expandvars gave "$s3cret")
    ("$$$SECRET", "$s3cret"),
    ("price: 5 $$", "price: 5 $"),
    ("no dollar", "no dollar"),
])  # fmt: skip
def test_expansion(value, expected):
    assert parse_headers([f"X-Test: {value}"], ENV) == {"X-Test": expected}


@pytest.mark.parametrize("value, message", [
    ("Bearer $MISSING", "--header Authorization: $MISSING is not set on this host"),
    ("Bearer ${MISSING}", "--header Authorization: ${MISSING} is not set on this host"),
    ("$SECRET and $MISSING", "--header Authorization: $MISSING is not set on this host"),
    ("pa$word1", "--header Authorization: $word1 is not set on this host"),
    ("5$", "--header Authorization: the '$' at character 2 of the value starts no $VAR or ${VAR}; write $$ for a literal $"),
    ("$1abc", "the '$' at character 1 of the value starts no $VAR"),
    ("${SECRET", "the '$' at character 1 of the value starts no $VAR"),
    ("${}", "the '$' at character 1 of the value starts no $VAR"),
])  # fmt: skip
def test_unset_or_bare_dollar_is_an_error(value, message):
    with pytest.raises(OptionError) as e:
        parse_headers([f"Authorization: {value}"], ENV)
    assert message in str(e.value)
    assert "s3cret" not in str(e.value)  # the message never carries a value


def test_default_environment_is_this_process(monkeypatch):
    monkeypatch.setenv("REPLAY_TEST_HEADER_VAR", "v")
    monkeypatch.delenv("REPLAY_TEST_HEADER_UNSET", raising=False)
    assert parse_headers(["X: $REPLAY_TEST_HEADER_VAR"]) == {"X": "v"}
    with pytest.raises(ValueError, match=r"--header X: \$REPLAY_TEST_HEADER_UNSET is not set on this host"):
        parse_headers(["X: $REPLAY_TEST_HEADER_UNSET"])
    assert "REPLAY_TEST_HEADER_UNSET" not in os.environ


def test_a_variable_cannot_smuggle_a_header_line():
    with pytest.raises(OptionError, match="--header 'X': the value holds a line break"):
        parse_headers(["X: $EVIL"], {"EVIL": "a\r\nX-Evil: 1"})
