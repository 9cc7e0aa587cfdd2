#!/usr/bin/python3
"""The service around Attend on the real mha_server: the model list and
details, health, reflection (v1alpha and v1), the metrics page counting
requests exactly, and concurrent mixed requests each answered correctly.

    /usr/bin/python3 tests/server/test_service.py [unittest options]
"""

import os
import sys
import unittest

import grpc
import numpy as np
from google.protobuf import descriptor_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_test_server import (MHA_SERVER, from_wire, half_tensor, metric_sample,  # noqa: E402
                             metric_value, tensor)
from test_server import (CROSS_E, CROSS_H, CROSS_KDIM, CROSS_VDIM, DEMO_E, DEMO_H,  # noqa: E402
                         POST_E, RPC_TIMEOUT, FourModelServerTest, cfg, health_grpc, health_pb2,
                         pb, randn, reference, reflection_grpc, reflection_pb2,
                         request_fields)


class ServiceTest(FourModelServerTest):
    """The service's calls besides Attend."""

    def test_list_models(self):
        response = self.stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT)
        models = {m.name: m for m in response.models}
        self.assertEqual(sorted(models), ["broken", "cross", "demo", "post"])
        ready = pb.ModelInfo.STATE_READY
        demo, cross, post, broken = (models[n] for n in ("demo", "cross", "post", "broken"))
        self.assertEqual(demo.state, ready)
        self.assertEqual(demo.weight_layout, "in_proj")
        self.assertEqual(demo.parameter_count, 4 * DEMO_E * DEMO_E + 4 * DEMO_E)
        self.assertEqual((demo.embed_dim, demo.num_heads, demo.kdim, demo.vdim),
                         (DEMO_E, DEMO_H, DEMO_E, DEMO_E))
        self.assertEqual((demo.config.embed_dim, demo.config.num_heads), (DEMO_E, DEMO_H))
        self.assertEqual(demo.error, "")
        self.assertEqual(cross.state, ready)
        self.assertEqual(cross.weight_layout, "separate_proj_weights")
        self.assertEqual(cross.parameter_count,
                         sum(p.numel() for p in self.models["cross"][0].parameters()))
        self.assertEqual((cross.embed_dim, cross.num_heads, cross.kdim, cross.vdim),
                         (CROSS_E, CROSS_H, CROSS_KDIM, CROSS_VDIM))
        self.assertEqual(post.state, ready)
        self.assertEqual(post.weight_layout, "in_proj")
        self.assertEqual(post.parameter_count, 4 * POST_E * POST_E + 4 * POST_E + 2 * POST_E)
        self.assertTrue(post.config.HasField("post_norm"))
        self.assertEqual(broken.state, pb.ModelInfo.STATE_FAILED)
        self.assertIn("model 'broken' failed to load", broken.error)
        self.assertIn("outside the data section", broken.error)
        self.assertEqual(broken.weight_layout, "")
        self.assertEqual(broken.parameter_count, 0)

    def test_get_model(self):
        listed = {m.name: m for m in self.stub.ListModels(pb.ListModelsRequest(),
                                                          timeout=RPC_TIMEOUT).models}
        for name in ("cross", "broken"):
            info = self.stub.GetModel(pb.GetModelRequest(name=name), timeout=RPC_TIMEOUT)
            self.assertEqual(info, listed[name])
        self.assertEqual(info.state, pb.ModelInfo.STATE_FAILED)
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.GetModel(pb.GetModelRequest(name="nosuch"), timeout=RPC_TIMEOUT)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("model 'nosuch' not found", caught.exception.details())

    # --- 6. health --------------------------------------------------------

    def test_health(self):
        health = health_grpc.HealthStub(self.channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for service, status in (("", serving), ("demo", serving), ("cross", serving),
                                ("post", serving), ("broken", not_serving)):
            with self.subTest(service=service):
                response = health.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=RPC_TIMEOUT)
                self.assertEqual(response.status, status)
        with self.assertRaises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="nosuch"), timeout=RPC_TIMEOUT)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)

    # --- 7. reflection ----------------------------------------------------

    def test_reflection(self):
        reflection = reflection_grpc.ServerReflectionStub(self.channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="mha.v1.AttentionService")]
        responses = list(reflection.ServerReflectionInfo(iter(requests), timeout=RPC_TIMEOUT))
        self.assertEqual(len(responses), 2)
        self.assertEqual(responses[0].WhichOneof("message_response"), "list_services_response")
        services = {s.name for s in responses[0].list_services_response.service}
        self.assertIn("mha.v1.AttentionService", services)
        self.assertIn("grpc.health.v1.Health", services)
        self.assertEqual(responses[1].WhichOneof("message_response"), "file_descriptor_response")
        files = {}
        for blob in responses[1].file_descriptor_response.file_descriptor_proto:
            f = descriptor_pb2.FileDescriptorProto.FromString(blob)
            files[f.name] = f
        self.assertIn("mha/v1/attention.proto", files)
        methods = {m.name for s in files["mha/v1/attention.proto"].service for m in s.method}
        self.assertEqual(methods, {"Attend", "ListModels", "GetModel", "LoadModel", "UnloadModel",
                                   "GetModelStatistics", "OpenSession", "Append",
                                   "CloseSession", "ListSessions", "ForkSession",
                                   "ExportSession", "ImportSession", "Stream"})

    def test_reflection_v1_describes_every_service_health_included(self):
        # What a reflection-only tool does: list, fetch descriptors, build
        # the messages from them (no local protos) and call Health/Check.
        from google.protobuf import descriptor_pool, message_factory
        from mha_test_server import load_reflection_v1_stubs
        rpb, rgrpc = load_reflection_v1_stubs()
        reflection = rgrpc.ServerReflectionStub(self.channel)
        requests = [rpb.ServerReflectionRequest(list_services="")] + [
            rpb.ServerReflectionRequest(file_containing_symbol=name) for name in
            ("grpc.health.v1.Health", "inference.GRPCInferenceService",
             "grpc.reflection.v1.ServerReflection", "no.such.Symbol")]
        responses = list(reflection.ServerReflectionInfo(iter(requests), timeout=RPC_TIMEOUT))
        services = {s.name for s in responses[0].list_services_response.service}
        self.assertEqual(services, {"mha.v1.AttentionService", "inference.GRPCInferenceService",
                                    "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                                    "grpc.reflection.v1alpha.ServerReflection"})
        for r in responses[1:4]:
            self.assertEqual(r.WhichOneof("message_response"), "file_descriptor_response")
        self.assertEqual(responses[4].error_response.error_code, grpc.StatusCode.NOT_FOUND.value[0])
        pool = descriptor_pool.DescriptorPool()
        for blob in responses[1].file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(blob))
        factory = message_factory.MessageFactory(pool)  # protobuf 3.21's spelling
        request_class = factory.GetPrototype(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest"))
        response_class = factory.GetPrototype(
            pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse"))
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=request_class.SerializeToString,
                                         response_deserializer=response_class.FromString)
        reply = check(request_class(service="demo"), timeout=RPC_TIMEOUT)
        self.assertEqual(response_class.DESCRIPTOR.fields_by_name["status"].enum_type
                         .values_by_number[reply.status].name, "SERVING")
        # v1alpha describes the health service too now.
        alpha = reflection_grpc.ServerReflectionStub(self.channel)
        answer = list(alpha.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.health.v1.Health")]), timeout=RPC_TIMEOUT))
        self.assertEqual(answer[0].WhichOneof("message_response"), "file_descriptor_response")

    # --- 8. metrics -------------------------------------------------------

    def test_metrics_count_requests_exactly(self):
        before = self.server.metrics()
        n_ok, n_invalid, n_unknown = 3, 2, 2
        shapes = [(1, 3), (2, 5), (1, 1)]  # (B, L)
        for b, length in shapes:
            self.attend(**request_fields(randn(self.rng, b, length, DEMO_E)))
        for _ in range(n_invalid):
            with self.assertRaises(grpc.RpcError):
                self.attend(query=tensor(pb, cfg, randn(self.rng, 1, 3, 255)))
        for i in range(n_unknown):
            with self.assertRaises(grpc.RpcError):
                self.attend(f"no_such_model_{i}",
                            **request_fields(randn(self.rng, 1, 3, DEMO_E)))
        with self.assertRaises(grpc.RpcError):
            self.attend("broken", **request_fields(randn(self.rng, 1, 3, DEMO_E)))
        after = self.server.metrics()

        def delta(name, **labels):
            return metric_value(after, name, **labels) - metric_value(before, name, **labels)

        self.assertEqual(delta("mha_requests_total", model="demo", code="OK"), n_ok)
        self.assertEqual(delta("mha_requests_total", model="demo", code="INVALID_ARGUMENT"),
                         n_invalid)
        self.assertEqual(delta("mha_requests_total", model="_unknown", code="NOT_FOUND"),
                         n_unknown)
        self.assertEqual(delta("mha_requests_total", model="broken", code="FAILED_PRECONDITION"),
                         1)
        self.assertEqual(delta("mha_request_duration_seconds_count", model="demo"),
                         n_ok + n_invalid)
        self.assertGreater(delta("mha_request_duration_seconds_sum", model="demo"), 0)
        # Self-attention: query + key tokens are 2 x B x L.
        self.assertEqual(delta("mha_tokens_total", model="demo"),
                         sum(2 * b * length for b, length in shapes))
        self.assertNotIn("no_such_model", after)
        self.assertEqual(metric_sample(after, "mha_model_loaded", model="broken"), 0)
        for name in ("demo", "cross", "post"):
            self.assertEqual(metric_sample(after, "mha_model_loaded", model=name), 1, name)
        self.assertEqual(metric_sample(after, "mha_inflight_requests", model="demo"), 0)

    # --- batching ---------------------------------------------------------

    def test_concurrent_mixed_requests_are_each_answered_correctly(self):
        """Requests that the batcher may merge (or must keep apart) each get
        their own answer."""
        specs = []
        for i in range(16):
            length = 1 + (i * 5) % 11
            query = randn(self.rng, 1 + i % 2, length, DEMO_E)
            if i % 4 == 3:
                query = query[0]  # unbatched
            spec = {"query": query}
            if i % 3 == 1:
                spec["key_padding_mask"] = np.zeros(query.shape[:-1], dtype=bool)
                spec["key_padding_mask"][..., -1] = length > 1
            if i % 5 == 2:
                spec["is_causal"] = True
            specs.append((spec, i % 4 == 1, i % 8 == 1, i % 6 == 5))
        futures = []
        for spec, need_weights, per_head, fp16 in specs:
            fields = request_fields(**spec, need_weights=need_weights,
                                    per_head_weights=per_head)
            if fp16:
                fields["query"] = half_tensor(pb, cfg, spec["query"], cfg.DATA_TYPE_FP16)
            futures.append(self.stub.Attend.future(pb.AttendRequest(model="demo", **fields),
                                                   timeout=RPC_TIMEOUT))
        for i, ((spec, need_weights, per_head, fp16), future) in enumerate(zip(specs, futures)):
            with self.subTest(request=i):
                response = future.result()
                query = spec.pop("query")
                if fp16:
                    self.assertEqual(response.output.dtype, cfg.DATA_TYPE_FP16)
                    query = from_wire(cfg, half_tensor(pb, cfg, query, cfg.DATA_TYPE_FP16))
                    ref_out, _ = reference(self.models["demo"], query, **spec)
                    self.assert_close(from_wire(cfg, response.output), ref_out, tol=2e-3)
                else:
                    self.check_against_torch("demo", response, query, need_weights=need_weights,
                                             per_head=per_head, **spec)


if __name__ == "__main__":
    if not os.access(MHA_SERVER, os.X_OK):
        sys.exit(f"test_service.py: no executable server at {MHA_SERVER} (set MHA_SERVER)")
    unittest.main(verbosity=2)
