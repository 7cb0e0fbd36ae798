"""What a decoder process (gateway/audio/decoder.py) does to itself before it reads a stranger's clip, so
that FFmpeg subverted by one reaches as little as possible of the gateway:

- it closes every descriptor it inherited but stdin, stdout and stderr (uvloop's spawn, unlike
  subprocess's close_fds, leaves inheritable descriptors open in the child: the gateway's listening socket
  was one, and a subverted decoder could have accepted clients' connections);
- it sets no_new_privs (no setuid program can give it more rights);
- where the kernel has Landlock (Linux 5.13+), it may then read and run only the files of Python and its
  import path (its modules, the shared libraries under /usr and /lib), nothing else: not /proc (so not the
  gateway's environment, which holds its API keys), not /etc, /home or the working files of the host; it
  may write no file; from Landlock ABI 4 (Linux 6.7) it may neither bind nor connect a TCP socket, and from
  ABI 6 (Linux 6.12) it may neither signal a process outside its sandbox nor connect to an abstract UNIX
  socket. Landlock also keeps it from ptracing the gateway.

docs/deploy.md ("The reference-audio decoders' sandbox") says what this does not stop. Each step is
applied where the platform has it and skipped where not.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

_PR_SET_NO_NEW_PRIVS = 38
# Landlock's system calls have one number on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_READ_ONLY = _EXECUTE | _READ_FILE | _READ_DIR
_FILE_RIGHTS = _EXECUTE | _READ_FILE  # a rule on a file (not a folder) may name only file rights
# Every filesystem right each ABI knows (ABI 2 adds REFER, 3 TRUNCATE, 5 IOCTL_DEV): handled, so denied
# unless a rule grants it.
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_BIND_CONNECT_TCP = (1 << 0) | (1 << 1)  # ABI 4
_SCOPE_ABSTRACT_UNIX_AND_SIGNAL = (1 << 0) | (1 << 1)  # ABI 6
# System folders shared libraries are loaded from (a module imported late may need one).
_SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib", "/lib64", "/etc/ld.so.cache")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def close_inherited_descriptors() -> None:
    """Close every descriptor but 0, 1 and 2 (the clip's pipes and the log)."""
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def confine() -> None:
    """no_new_privs, then Landlock where the kernel has it (see the module doc). Call it once the process
    has read what it needs outside (/proc/self) and imported what it decodes with."""
    libc = _libc()
    if libc is None or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return  # Landlock requires no_new_privs
    _landlock(libc)


def landlock_abi() -> int:
    """The Landlock ABI this kernel has; 0 where it has none (or it is disabled)."""
    libc = _libc()
    return max(_syscall(libc, _CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)),
               0) if libc is not None else 0


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _syscall(libc: ctypes.CDLL, number: int, *args) -> int:
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(number), *args)


def _readable_roots() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable),
             *_SYSTEM_LIBRARIES, *(p for p in sys.path if p)}
    return sorted(root for root in roots if os.path.exists(root))


def _landlock(libc: ctypes.CDLL) -> None:
    """Restrict this process to reading Python and its import path (see the module doc), where the kernel
    has Landlock."""
    abi = landlock_abi()
    if not abi:
        return
    attr = _RulesetAttr(_FS_RIGHTS[min(abi, 5)], _NET_BIND_CONNECT_TCP if abi >= 4 else 0,
                        _SCOPE_ABSTRACT_UNIX_AND_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the fields this ABI reads
    ruleset = _syscall(libc, _CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return
    try:
        for root in _readable_roots():
            try:
                fd = os.open(root, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rights = _READ_ONLY if os.path.isdir(root) else _FILE_RIGHTS
                rule = _PathBeneathAttr(rights, fd)
                _syscall(libc, _ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                         ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        _syscall(libc, _RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
