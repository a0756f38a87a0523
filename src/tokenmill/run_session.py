"""`tokenmill run`'s interactive chat, with the commands of Ollama's: /set (parameter, system, format,
verbose), /show (info, modelfile, parameters, system, template), /load and /save, /clear, /bye, /?,
and \"\"\" around a multi-line message. The session (conversation, system message, options) lives
here; run_chats.py's chats answer each turn through a server or in-process."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokenmill.engine import SamplingParams
from tokenmill.run_chats import Thought, Turn

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a model (the conversation starts over)
  /save <model>   Save the session as a model: its system message, parameters and messages
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message."""
SET_HELP = """Available Commands:
  /set parameter <name> <value>  Set a parameter (temperature, num_predict, top_k, top_p, seed, stop ...)
  /set system <string>           Set the system message
  /set format json               Answer in JSON
  /set noformat                  Answer in free text
  /set verbose                   Show the figures of each answer
  /set quiet                     Do not show them
  /set think                     Let a thinking model think (its reasoning shown before the answer)
  /set nothink                   Turn its thinking off"""
SHOW_HELP = """Available Commands:
  /show info         Show details for this model
  /show modelfile    Show the Modelfile for this model
  /show parameters   Show the parameters of this session and model
  /show system       Show the system message
  /show template     Show the prompt template"""


@dataclass
class Session:
    """What an interactive chat keeps between turns."""
    history: list[dict] = field(default_factory=list)
    system: str | None = None
    options: dict = field(default_factory=dict)  # Ollama option names, set with /set parameter
    format: str | None = None
    verbose: bool = False
    think: bool | str | None = None  # None: the model's default (a thinking model thinks)
    hide_thinking: bool = False

    def turn(self, prompt: str) -> Turn:
        return Turn(prompt, list(self.history), self.system, dict(self.options), self.format, think=self.think)


def read_message(ask: Callable[[str], str]) -> str:
    """One message: a line, or the lines between \"\"\" and \"\"\" (Ollama's multi-line input).
    EOFError when input ends."""
    line = ask(">>> ")
    if not line.lstrip().startswith('"""'):
        return line
    text = line.lstrip()[3:]
    if text.rstrip().endswith('"""') and text.strip() != "":
        return text.rstrip()[:-3]
    parts = [text] if text else []
    while True:
        line = ask("... ")
        if line.rstrip().endswith('"""'):
            last = line.rstrip()[:-3]
            return "\n".join(parts + [last] if last else parts)
        parts.append(line)


class Commands:
    """The slash commands of one session over one chat (which /load replaces)."""

    def __init__(self, chat, session: Session, open_chat: Callable[[str], object]):
        self.chat, self.session, self.open_chat = chat, session, open_chat

    def run(self, line: str) -> bool:
        """Carry out a command line; False when the session ends."""
        words = line.split()
        name, args = words[0], words[1:]
        if name in ("/bye", "/exit", "/quit"):
            return False
        handler = {"/clear": self._clear, "/set": self._set, "/show": self._show, "/load": self._load,
                   "/save": self._save, "/?": self._help, "/help": self._help}.get(name)
        if handler is None:
            _say(f"Unknown command '{name}'. Type /? for help")
        else:
            handler(args, line)
        return True

    def _help(self, args: list[str], line: str) -> None:
        print({"set": SET_HELP, "show": SHOW_HELP}.get(args[0] if args else "", HELP))

    def _clear(self, args: list[str], line: str) -> None:
        self.session.history.clear()
        _say("Cleared session context")

    def _set(self, args: list[str], line: str) -> None:
        s = self.session
        what = args[0] if args else ""
        if what == "parameter" and len(args) >= 3:
            from tokenmill.store.modelfile import typed_parameter

            name = args[1].lower()
            # stop takes several words, each one stop string (quotes around one are not part of it)
            value = ([w.strip('"') for w in args[2:]] if name == "stop"
                     else typed_parameter(name, " ".join(args[2:]), "/set parameter"))
            if not self.chat.takes_option(name):
                _say(f"error: /set parameter {name}: only a server uses it (start one with `tokenmill serve`)")
            elif value is None:
                _say(f"Parameter '{name}' means nothing here: ignored, as a server ignores it")
            else:
                s.options[name] = value
                _say(f"Set parameter '{name}' to '{', '.join(value) if name == 'stop' else value}'")
        elif what == "system" and len(args) >= 2:
            s.system = line.split(None, 2)[2].strip().strip('"')
            _say("Set system message.")
        elif what == "format" and args[1:] == ["json"]:
            s.format = "json"
            _say("Set format to 'json' mode.")
        elif what == "noformat" and len(args) == 1:
            s.format = None
            _say("Disabled format.")
        elif what in ("verbose", "quiet") and len(args) == 1:
            s.verbose = what == "verbose"
            _say(f"Set '{what}' mode.")
        elif what in ("think", "nothink") and len(args) == 1:
            s.think = what == "think"
            _say(f"Set '{what}' mode.")
        else:
            print(SET_HELP)

    def _show(self, args: list[str], line: str) -> None:
        from tokenmill.cli_models import model_details, print_details

        what = args[0] if len(args) == 1 else ""
        if what not in ("info", "modelfile", "parameters", "system", "template"):
            print(SHOW_HELP)
            return
        if what == "system" and self.session.system is not None:
            print(self.session.system)
            return
        if what == "parameters" and self.session.options:
            print("User defined parameters:")
            for name, value in self.session.options.items():
                print(f"{name:<16} {' '.join(value) if isinstance(value, list) else value}")
        info = model_details(self.chat.model, getattr(self.chat, "base_url", None))
        if what == "info":
            print_details(info)
        elif what == "parameters":
            print("Model defined parameters:" if info.get("parameters") else "No model parameters were set.")
            if info.get("parameters"):
                print(info["parameters"])
        else:
            text = info.get(what, "")
            print(text if text else f"No {what} was specified for this model.", end="" if text.endswith("\n") else "\n")

    def _load(self, args: list[str], line: str) -> None:
        if len(args) != 1:
            _say("Usage: /load <model>")
            return
        _say(f"Loading model '{args[0]}'")
        self.chat = self.open_chat(args[0])
        self.session.history.clear()

    def _save(self, args: list[str], line: str) -> None:
        from tokenmill.cli_models import create_model

        if len(args) != 1:
            _say("Usage: /save <model>")
            return
        s = self.session
        body = {"model": args[0], "from": self.chat.model, "stream": False,
                **({"system": s.system} if s.system is not None else {}),
                **({"parameters": s.options} if s.options else {}),
                **({"messages": s.history} if s.history else {})}
        create_model(body, server=getattr(self.chat, "base_url", None))
        _say(f"Created new model '{args[0]}'")


def print_stream(chunks: Iterator[str], hide_thinking: bool = False) -> str:
    """Writes an answer as it comes and returns it. A thinking model's reasoning (Thought pieces) is
    written first between "Thinking..." and "...done thinking.", as `ollama run` shows it, or not at all
    (`hide_thinking`); it is not part of the answer returned (what the conversation keeps)."""
    parts = []
    thinking = False
    try:
        for text in chunks:
            if isinstance(text, Thought):
                if not hide_thinking:
                    sys.stdout.write(text if thinking else "Thinking...\n" + text)
                    sys.stdout.flush()
                    thinking = True
                continue
            if thinking and text:
                sys.stdout.write("\n...done thinking.\n\n")
                thinking = False
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
        if thinking:  # the tokens ran out while it thought
            sys.stdout.write("\n...done thinking.\n")
    except BaseException:
        if parts:  # the error (or Ctrl-C's exit) goes on a line of its own, not glued to the answer
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    return "".join(parts)


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def line_editing() -> Callable[[], None]:
    """On a real terminal, line editing and a history kept across chats (TOKENMILL_HOME/history, as
    Ollama keeps ~/.ollama/history); returns what saves the history when the chat ends."""
    if sys.stdin is not sys.__stdin__ or not sys.stdin.isatty():
        return lambda: None
    try:
        import readline
    except ImportError:  # a Python built without it: plain input
        return lambda: None
    from tokenmill.store.local import models_dir

    path = models_dir().parent / "history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # none yet
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass  # a history is a convenience: a home that cannot take it loses nothing else

    return save


def interactive(chat, params: SamplingParams, open_chat: Callable[[str], object], *, verbose: bool = False,
                format: str | None = None, think: bool | str | None = None, hide_thinking: bool = False,
                ask: Callable[[str], str] = input) -> int:
    """Read messages and commands until /bye or the end of input. A message whose answer fails (a
    bad parameter, a server gone) says why and the session goes on."""
    session = Session(format=format, verbose=verbose, think=think, hide_thinking=hide_thinking)
    commands = Commands(chat, session, open_chat)
    _say('Type a message (/? for help, """ for several lines); /bye or Ctrl-D to leave.')
    save_history = line_editing()
    try:
        return _loop(commands, session, params, ask)
    finally:
        save_history()


def _loop(commands: Commands, session: Session, params: SamplingParams, ask: Callable[[str], str]) -> int:
    from tokenmill.server_client import ServerError
    from tokenmill.store import StoreError

    while True:
        try:
            message = read_message(ask)
        except EOFError:
            _say("")
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as Ollama's
            _say("")
            continue
        if not message.strip():
            continue
        try:
            if message.startswith("/"):
                if not commands.run(message.strip()):
                    return 0
                continue
            reply = print_stream(commands.chat.stream(session.turn(message), params), session.hide_thinking)
        except KeyboardInterrupt:
            _say("\n(interrupted)")
            continue
        except (ServerError, StoreError, RuntimeError, ValueError, OSError) as exc:
            _say(f"error: {exc}")
            continue
        session.history += [{"role": "user", "content": message}, {"role": "assistant", "content": reply}]
        if session.verbose and commands.chat.stats is not None:
            _say("\n".join(commands.chat.stats.lines()))
