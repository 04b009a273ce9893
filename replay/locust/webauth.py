"""The web UI's login: `--web-user USER:PASSWORD`, checked on Locust's own login page.

Locust's `--web-login` only switches flask_login on: every page, the Replay view included,
then sends the browser to a login form that nothing answers, unless the locustfile registers
a user loader and a form handler. This module is that part, so a UI that can start and stop
the replay can be opened to a network without being opened to everyone on it.

- `--web-user` alone turns the login on: credentials given and a UI left open would be the
  worst surprise. `--web-login` without `--web-user` is refused at start-up (exit 2): it
  would serve a UI nobody can enter.
- `$VAR` / `${VAR}` in the value is read from the environment (`'admin:$WEB_PASSWORD'`), so
  the password stays out of `ps`, shell history and config files. An unset variable or an
  empty password is an error, never a password.
- One user. Sessions are signed with a key made at start-up: they end with the process.
- A UI on all interfaces with no login gets a warning in the log.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from flask import Response, redirect, request, session, url_for
from flask_login import LoginManager, UserMixin, current_user, login_user
from locust.runners import WorkerRunner

from replay import env_vars
from replay.run.config import apply_config

logger = logging.getLogger(__name__)

ALL_INTERFACES = ("", "*", "0.0.0.0", "::")
NEXT = "replay_login_next"  # session key: the page the login page was shown for
FAILED = "Invalid username or password"


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str = field(repr=False)  # never in a log line or a traceback

    def match(self, user: str, password: str) -> bool:
        """Constant-time on both parts, so the answer's timing tells nothing about either."""
        ok_user = hmac.compare_digest(user.encode(), self.user.encode())
        ok_password = hmac.compare_digest(password.encode(), self.password.encode())
        return ok_user and ok_password


class User(UserMixin):
    def __init__(self, name: str):
        self.id = name


def parse_web_user(value: str, environ: Mapping[str, str] = os.environ) -> Credentials:
    """`USER:PASSWORD` (the password may hold ':'), `$VAR`s expanded once by replay.env_vars' rule
    ($$ a literal $); errors never show the password."""
    user, sep, password = value.partition(":")
    if not sep:
        raise ValueError("--web-user: expected USER:PASSWORD (e.g. 'admin:$WEB_PASSWORD')")

    user, password = (env_vars.expand(user, "--web-user", environ).strip(),
                      env_vars.expand(password, "--web-user", environ, start=len(user) + 1))
    if not user:
        raise ValueError("--web-user: the user name is empty")
    if not password:
        raise ValueError(f"--web-user: the password for {user!r} is empty")
    return Credentials(user, password)


def safe_next(target: str | None, base: str) -> str | None:
    """A page of this UI to return to after the login: a local path only, never another site."""
    if not target or not target.startswith(f"{base}/") or target.startswith("//") or "\\" in target:
        return None
    return target


def register(environment, runner, web_ui) -> None:
    """Called by replay.locust.plugin's init listener: the login, when this process serves a UI."""
    if web_ui is None or isinstance(runner, WorkerRunner):
        return  # no UI (headless, workers): nothing to protect
    parsed = environment.parsed_options
    try:
        apply_config(parsed)  # `web-user:` may come from --replay-config
        value = getattr(parsed, "web_user", None)
        credentials = parse_web_user(value) if value else None
    except ValueError as e:
        logger.error("replay: %s", e)
        sys.exit(2)
    if credentials is not None:
        enable_login(web_ui, credentials, base=getattr(parsed, "web_base_path", None) or "")
        logger.info("web UI login on: user %r", credentials.user)
    elif web_ui.web_login:
        logger.error("replay: --web-login needs --web-user USER:PASSWORD, the login it checks"
                     " (e.g. --web-user 'admin:$WEB_PASSWORD')")  # fmt: skip
        sys.exit(2)
    elif web_ui.host in ALL_INTERFACES:
        logger.warning("the web UI listens on all interfaces with no login: anyone who reaches port %s can start"
                       " and stop the replay; use --web-host 127.0.0.1 or --web-user USER:PASSWORD", web_ui.port)


def enable_login(web_ui, credentials: Credentials, base: str = "") -> None:
    """Locust's login page, answered by a check of `credentials`; turns --web-login on if needed."""
    app = web_ui.app
    if not web_ui.web_login:  # --web-user alone: what Locust's WebUI does itself for --web-login
        manager = LoginManager()
        manager.init_app(app)
        manager.login_view = "locust.login"
        web_ui.login_manager = manager
        web_ui.web_login = True
    app.secret_key = secrets.token_bytes(32)
    app.config["SESSION_COOKIE_SAMESITE"] = "Lax"  # no cookie on another site's POST to /swarm or /stop
    web_ui.login_manager.user_loader(lambda name: User(name) if name == credentials.user else None)
    web_ui.auth_args = {"username_password_callback": f"{base}/login_submit"}

    @app.before_request
    def remember_next() -> None:
        # flask_login sends a browser to /login?next=/replay; Locust's form does not post `next` back
        if request.endpoint == "locust.login" and (target := safe_next(request.args.get("next"), base)):
            session[NEXT] = target

    def login_submit() -> Response:
        user, password = request.form.get("username", ""), request.form.get("password", "")
        if credentials.match(user, password):
            login_user(User(credentials.user))
            return redirect(safe_next(session.pop(NEXT, None), base) or url_for("locust.index"))
        logger.warning("web UI: failed login as %r from %s", user[:64], request.remote_addr)
        session["auth_error"] = FAILED
        return redirect(url_for("locust.login"))

    app.add_url_rule(f"{base}/login_submit", "replay_login_submit", login_submit, methods=["POST"])


def logged_in(web_ui) -> bool:
    """Whether this request may act: no login asked for, or the user has logged in."""
    return not web_ui.web_login or current_user.is_authenticated
