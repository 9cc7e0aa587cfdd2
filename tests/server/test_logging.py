#!/usr/bin/python3
"""The server's logger against the real mha_server (issue 86: one logger):

    /usr/bin/python3 tests/server/test_logging.py [unittest options]

- every line it writes has a level, a UTC timestamp and the thread, in the
  format asked for (Triton's default layout, ISO8601, or JSON lines);
- Triton's logging extension: LogSettings over gRPC and GET/POST /v2/logging
  read and change the settings at run time, all or none, and refuse unknown
  names, wrong types, unknown formats and a new log_file;
- --log_file sends the lines to a file; bad logging flags exit 2.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.error
import urllib.request

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import (MHA_SERVER, REPO_ROOT, OneServerPerClass, TestServer,  # noqa: E402
                             wait_for)
import mha_client  # noqa: E402
from mha_local_server import free_port  # noqa: E402

kpb, krpc = mha_client.load_kserve_stubs()
TIMEOUT = 30.0
DEFAULT_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+\] ")
ISO8601_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [IWE] \d+\] ")
JSON_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
DEFAULTS = {"log_file": "", "log_info": True, "log_warnings": True, "log_errors": True,
            "log_verbose_level": 0, "log_format": "json"}


def read_text(path):
    with open(path) as f:
        return f.read()


def demo_repository(folder):
    shutil.copytree(os.path.join(REPO_ROOT, "models", "demo"), os.path.join(folder, "demo"))


class LoggingSettingsTest(OneServerPerClass):
    """One server on JSON lines, with model control, whose log settings each
    test changes through both doors (and setUp puts back)."""

    @classmethod
    def make_repository(cls, folder):
        demo_repository(folder)

    @classmethod
    def setUpClass(cls):
        cls.server_flags = ("--log_format=json", "--model_control_mode=explicit",
                            "--load_model=demo", f"--http_port={free_port()}")
        super().setUpClass()
        cls.start_log = cls.server.stderr()  # before any test changes the format
        cls.kserve = krpc.GRPCInferenceServiceStub(cls.channel)

    def setUp(self):
        status, body = self.http("POST", DEFAULTS)
        self.assertEqual((status, body), (200, DEFAULTS))

    def http(self, method, body=None):
        """(status, JSON answer) of /v2/logging."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.http_port}/v2/logging", data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def grpc_settings(self, **settings):
        request = kpb.LogSettingsRequest()
        for name, value in settings.items():
            field = ("bool_param" if isinstance(value, bool) else
                     "uint32_param" if isinstance(value, int) else "string_param")
            setattr(request.settings[name], field, value)
        response = self.kserve.LogSettings(request, timeout=TIMEOUT)
        return {name: getattr(v, v.WhichOneof("parameter_choice"))
                for name, v in response.settings.items()}

    def lines_after(self, mark):
        """The stderr lines written after the first `mark` bytes."""
        return self.server.stderr()[mark:].splitlines()

    def test_every_line_is_a_json_object(self):
        lines = self.start_log.splitlines()
        self.assertTrue(lines)
        for line in lines:
            entry = json.loads(line)
            self.assertRegex(entry["time"], JSON_TIME)
            self.assertIn(entry["level"], ("INFO", "WARNING", "ERROR", "VERBOSE"))
            self.assertIsInstance(entry["thread"], int)
            self.assertIsInstance(entry["message"], str)
        ready = [json.loads(line) for line in lines if "mha_server ready" in line]
        self.assertEqual(len(ready), 1)
        self.assertEqual(ready[0]["level"], "INFO")
        self.assertEqual(ready[0]["message"], self.server.ready_line)

    def test_the_logging_extension_is_in_the_server_metadata(self):
        meta = self.kserve.ServerMetadata(kpb.ServerMetadataRequest(), timeout=TIMEOUT)
        self.assertIn("logging", list(meta.extensions))

    def test_grpc_reads_and_changes_the_settings(self):
        self.assertEqual(self.grpc_settings(), DEFAULTS)
        mark = len(self.server.stderr())
        self.assertEqual(self.grpc_settings(log_verbose_level=1),
                         dict(DEFAULTS, log_verbose_level=1))
        self.kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="demo"),
                                        timeout=TIMEOUT)
        entries = [json.loads(line) for line in self.lines_after(mark)]
        self.assertIn({"level": "VERBOSE", "message": "model control: load 'demo' asked"},
                      [{"level": e["level"], "message": e["message"]} for e in entries])
        self.assertEqual(self.http("GET")[1]["log_verbose_level"], 1)

    def test_each_format_as_asked(self):
        for name, pattern in (("ISO8601", ISO8601_LINE), ("default", DEFAULT_LINE)):
            mark = len(self.server.stderr())
            self.assertEqual(self.http("POST", {"log_format": name}),
                             (200, dict(DEFAULTS, log_format=name)))
            changed = [line for line in self.lines_after(mark) if "log settings changed" in line]
            self.assertEqual(len(changed), 1, self.lines_after(mark))
            self.assertRegex(changed[0], pattern)
            self.assertTrue(changed[0].endswith(f"log_format={name} log_info=true "
                                                "log_warnings=true log_errors=true "
                                                "log_verbose_level=0"), changed[0])

    def test_a_level_turned_off_writes_nothing(self):
        self.assertEqual(self.http("POST", {"log_info": False})[0], 200)
        mark = len(self.server.stderr())
        self.kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="demo"),
                                          timeout=TIMEOUT)
        self.kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="demo"),
                                        timeout=TIMEOUT)
        self.assertEqual(self.lines_after(mark), [])
        self.assertEqual(self.http("POST", {"log_info": True})[0], 200)
        mark = len(self.server.stderr())
        self.kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="demo"),
                                          timeout=TIMEOUT)
        self.kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="demo"),
                                        timeout=TIMEOUT)
        messages = [json.loads(line)["message"] for line in self.lines_after(mark)]
        self.assertIn("model 'demo' unloaded", messages)
        self.assertIn("model 'demo' version 1 loaded", messages)

    def test_refusals_change_nothing(self):
        refused = {
            "unknown log setting 'log_colour'": {"log_colour": True},
            "log setting 'log_info' takes a boolean value": {"log_info": "yes"},
            "log setting 'log_verbose_level': expected a boolean, an integer":
                {"log_verbose_level": -1},
            "log_format 'xml' is not one of default, ISO8601, json": {"log_format": "xml"},
            "log_file is set at start (--log_file) and cannot be changed":
                {"log_file": "/tmp/elsewhere.log"},
        }
        for message, body in refused.items():
            status, answer = self.http("POST", dict(body, log_errors=False))
            self.assertEqual(status, 400, (body, answer))
            self.assertIn(message, answer["error"])
        self.assertEqual(self.http("GET"), (200, DEFAULTS))
        with self.assertRaises(grpc.RpcError) as e:
            self.grpc_settings(log_errors=False, log_warnings=7)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("log setting 'log_warnings' takes a boolean value", e.exception.details())
        self.assertEqual(self.grpc_settings(), DEFAULTS)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.http_port}/v2/logging", method="PUT", data=b"{}")
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=TIMEOUT)
        self.assertEqual(e.exception.code, 405)


class LogFlagsTest(unittest.TestCase):
    """--log_file and bad logging flags, each on its own server start."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="mha_test_logging_")
        demo_repository(self.tmp.name)
        self.addCleanup(self.tmp.cleanup)

    def test_log_file_takes_every_line(self):
        path = os.path.join(self.tmp.name, "server.log")
        flags = [f"--log_file={path}", f"--http_port={free_port()}"]
        with TestServer(MHA_SERVER, self.tmp.name, flags) as server:
            wait_for(lambda: "mha_server ready" in read_text(path), what="the ready line")
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{server.http_port}/v2/logging", timeout=TIMEOUT) as r:
                self.assertEqual(json.loads(r.read())["log_file"], path)
        lines = read_text(path).splitlines()
        self.assertTrue(any("signal 15, draining" in line for line in lines), lines)
        for line in lines:
            self.assertRegex(line, DEFAULT_LINE)
        self.assertNotIn("mha_server ready", server.stderr())
        server.remove_log()

    def test_bad_flags_exit_2_naming_the_flag(self):
        for flags, message in (
                (["--log_format=xml"],
                 "INVALID_ARGUMENT: log_format 'xml' is not one of default, ISO8601, json"),
                ([f"--log_file={self.tmp.name}/demo/config.pbtxt/x.log"],  # under a file
                 "INVALID_ARGUMENT: log_file '")):
            run = subprocess.run([MHA_SERVER, f"--model_repository={self.tmp.name}", "--port=0",
                                  "--metrics_port=0", "--http_port=0"] + flags,
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(run.returncode, 2, run.stderr)
            self.assertTrue(run.stderr.startswith(message), run.stderr)


if __name__ == "__main__":
    unittest.main()
