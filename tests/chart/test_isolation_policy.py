"""The chart's ValidatingAdmissionPolicy, its CEL evaluated with cel-python against the same
pods as the webhook's rules (tests/support/podkit.py): the two layers agree on runtime
classes and handlers, on devices.include resources, on pods/ephemeralcontainers; the CEL's
string escapes are the ones the API server takes."""

from __future__ import annotations

import re

import pytest
from support import podkit
from support.chartkit import (
    NAMESPACE,
    RELEASE,
    merged,
    render,
)
from support.isolationkit import ISOLATION_KINDS, POLICY, WEBHOOK, excluded_namespaces, kinds_of

from katamgr.admission.rules import Policy, validate

# --- the ValidatingAdmissionPolicy's CEL, evaluated -------------------------------------

def _cel_env():
    celpy = pytest.importorskip("celpy")
    return celpy, celpy.Environment()


# CEL's escapes in string literals (cel-spec langdef.md, "String and Bytes Values"): the API
# server refuses any other (seen: '\.' in a regex), where cel-python takes it as written.
_CEL_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'")
_CEL_ESCAPE = re.compile(r"\\(.)")
_CEL_ESCAPES = set("abfnrtv\\'\"`?xuU01234567")


def cel_escapes_ok(expression: str) -> bool:
    return all(m.group(1) in _CEL_ESCAPES for lit in _CEL_LITERAL.finditer(expression)
               for m in _CEL_ESCAPE.finditer(lit.group(1)))


def evaluate_policy(policy: dict, pod: dict, *, subresource: str = "",
                    params: dict | None = None, old: dict | None = None) -> tuple[bool, str | None]:
    """The policy's answer to a pod's CREATE, or with ``subresource`` or ``old`` (the
    oldObject) an UPDATE, as the API server runs it: (admitted, the first refusal's message)."""
    celpy, env = _cel_env()
    from celpy import celtypes, json_to_cel

    spec = policy["spec"]
    variables: dict = {}
    update = bool(subresource) or old is not None
    activation = {"object": json_to_cel(pod), "variables": celtypes.MapType(variables),
                  # null on a CREATE (admission.k8s.io's AdmissionRequest.oldObject)
                  "oldObject": json_to_cel(old),
                  # The API server leaves subResource out of a request on the resource itself
                  # (seen: "no such key: subResource" from a policy that read it unguarded).
                  "request": json_to_cel({"operation": "UPDATE" if update else "CREATE",
                                          **({"subResource": subresource} if subresource else {})})}
    if params is not None:
        activation["params"] = json_to_cel(params)
    # Kubernetes' CEL has the strings extension (cel-go ext.Strings: substring, split, trim,
    # join); cel-python's core does not.
    functions = {
        "substring": lambda text, start: celtypes.StringType(str(text)[int(start):]),
        "split": lambda text, sep: celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(sep))]),
        "trim": lambda text: celtypes.StringType(str(text).strip()),
        "join": lambda items, sep: celtypes.StringType(str(sep).join(str(i) for i in items)),
    }

    def run(expression: str):
        assert cel_escapes_ok(expression), f"an escape the API server's CEL refuses: {expression}"
        program = env.program(env.compile(expression), functions=functions)
        activation["variables"] = celtypes.MapType(variables)
        return program.evaluate(activation)

    for var in spec["variables"]:
        variables[celtypes.StringType(var["name"])] = run(var["expression"])
    for check in spec["validations"]:  # the API server reports the first that fails
        if not bool(run(check["expression"])):
            return False, str(run(check["messageExpression"]))
    return True, None


def rc(name: str, handler: str) -> dict:
    return {"metadata": {"name": name}, "handler": handler}


# The cluster's RuntimeClasses both layers read: katamgr's two; kata-deploy's, each named after
# its handler kata-<shim> (runtime-rs TDX and SNP here); kata-deploy's default class
# (runtimeClasses.createDefault: named "kata", the handler of its default shim, an NVIDIA GPU one
# in its try-kata-nvidia-gpu values: kata-deploy's templates/runtimeclasses.yaml, nameOverride);
# a Kata class that runs no GPU (kata-deploy's plain QEMU shim); runc.
GPU_RS = {"tdx": "kata-qemu-nvidia-gpu-tdx-runtime-rs", "snp": "kata-qemu-nvidia-gpu-snp-runtime-rs"}
CLUSTER = [rc(podkit.KATA, podkit.KATA), rc("kata-qemu-nvidia-gpu-snp", "kata-qemu-nvidia-gpu-snp"),
           rc(GPU_RS["tdx"], GPU_RS["tdx"]), rc(GPU_RS["snp"], GPU_RS["snp"]),
           rc("kata", podkit.KATA), rc("kata-qemu", "kata-qemu"), rc("runc", "runc")]
HANDLERS = {c["metadata"]["name"]: c["handler"] for c in CLUSTER}


def class_cases() -> dict[str, dict]:
    c, pod = podkit.container, podkit.pod
    return {**podkit.cases(),
            "kata-deploy-default": pod(c(limits={podkit.A10: "1"}), runtime_class="kata"),
            "tdx-runtime-rs": pod(c(limits={podkit.H100: "1"}), runtime_class=GPU_RS["tdx"]),
            "snp-runtime-rs-a10": pod(c(limits={podkit.A10: "1"}), runtime_class=GPU_RS["snp"]),
            "kata-without-gpu": pod(c(limits={podkit.A10: "1"}), runtime_class="kata-qemu"),
            "kata-without-gpu-no-request": pod(c(), runtime_class="kata-qemu")}


def admission(rendered, pod: dict, cluster: list[dict], *, subresource: str = "") -> list[str]:
    """The chart's two policies on a pod, as the API server runs them: the first refusal of
    each (the second once per RuntimeClass, each a param). The API server answers with one."""
    plain = rendered.get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    handler = rendered.get("ValidatingAdmissionPolicy", "-kata-handler")
    denials = []
    ok, message = evaluate_policy(plain, pod, subresource=subresource)
    if not ok:
        denials.append(message)
    for param in cluster:
        ok, message = evaluate_policy(handler, pod, subresource=subresource, params=param)
        if not ok:
            denials.append(message)
            break
    return denials


@pytest.mark.parametrize("case", sorted(class_cases()))
def test_the_policies_agree_with_the_webhook(chart, case):
    """The webhook as the chart runs it (--check-handlers: it reads the pod's RuntimeClass)
    and the two policies on the same cluster's RuntimeClasses: both admit, or both refuse
    and the webhook's sentence is one the policies give."""
    rendered = render(chart, POLICY)
    obj = class_cases()[case]
    denials = admission(rendered, obj, CLUSTER)
    denial = validate(obj, Policy(handler_of=HANDLERS.get))
    assert bool(denials) == (denial is not None), (case, denials, denial)
    if denial:
        # The same sentence as the webhook, less the pod name the policy's status already gives.
        assert denial.split(": ", 1)[1] in denials, (case, denials, denial)


def test_any_class_with_a_kata_gpu_handler_takes_a_passthrough_pod(chart):
    """The allow-list follows the Kata GPU classes present: kata-deploy's default class
    "kata" (handler kata-qemu-nvidia-gpu) and its runtime-rs TDX class are in no list, and
    take a passthrough GPU by their handlers; a Kata class without the GPU runtime does not."""
    rendered = render(chart, POLICY)
    cases = class_cases()
    for case in ("kata-deploy-default", "tdx-runtime-rs", "kata-without-gpu-no-request"):
        assert admission(rendered, cases[case], CLUSTER) == [], case
        assert validate(cases[case], Policy(handler_of=HANDLERS.get)) is None, case
    (refusal,) = admission(rendered, cases["kata-without-gpu"], CLUSTER)
    assert ('container "app" requests the passthrough resource nvidia.com/GA102GL_A10, but runtimeClassName '
            '"kata-qemu" has handler "kata-qemu", which is not a Kata GPU runtime; a passthrough GPU is only '
            "given to a Kata VM: set spec.runtimeClassName to a Kata GPU class (its handler "
            "kata-qemu-nvidia-gpu*, or one of kata-qemu-nvidia-gpu, ") in refusal
    # A runtime-rs SNP class is confidential (kata-deploy adds -runtime-rs after -snp).
    (refusal,) = admission(rendered, cases["snp-runtime-rs-a10"], CLUSTER)
    assert f'runtimeClassName "{GPU_RS["snp"]}" runs confidential VMs and the GPU model GA102GL_A10' in refusal
    # The class kata-deploy renamed, recreated with runc: refused by its handler.
    forged = [*(c for c in CLUSTER if c["metadata"]["name"] != "kata"), rc("kata", "runc")]
    (refusal,) = admission(rendered, cases["kata-deploy-default"], forged)
    assert 'runtimeClassName "kata" has handler "runc", which is not a Kata GPU runtime' in refusal
    assert refusal in validate(cases["kata-deploy-default"],
                               Policy(handler_of={"kata": "runc"}.get))


def test_a_kata_gpu_handler_of_your_own_is_a_value(chart):
    """kata-deploy's customRuntimes register a handler of the operator's choosing on its
    qemu-nvidia-gpu base (kata-my-gpu-runtime in its values' example)."""
    values = merged(POLICY, WEBHOOK, {"isolation": {"kataGpuHandlers": ["kata-qemu-nvidia-gpu*", "kata-my-gpu-*"]}})
    rendered = render(chart, values)
    mine = [*CLUSTER, rc("my-gpu", "kata-my-gpu-runtime")]
    obj = podkit.pod(podkit.container(limits={podkit.A10: "1"}), runtime_class="my-gpu")
    assert admission(rendered, obj, mine) == []
    policy = webhook_policy(rendered, handler_of={"my-gpu": "kata-my-gpu-runtime"}.get)
    assert policy.gpu_handlers == ("kata-qemu-nvidia-gpu*", "kata-my-gpu-*")
    assert validate(obj, policy) is None
    # With the chart's defaults it is refused by both.
    assert admission(render(chart, POLICY), obj, mine)
    assert validate(obj, Policy(handler_of={"my-gpu": "kata-my-gpu-runtime"}.get))


# --- devices.include resources are passthrough resources, whatever their domain ----------

INCLUDED = {"devices": {"include": [{"ids": "1234:11e8", "resource": "example.com/edu"},
                                    {"ids": "1234:1111", "resource": "example.com/vga"},
                                    {"ids": "1234:11e9", "resource": "example.com/edu"}]}}
EDU = "example.com/edu"


def webhook_policy(rendered, handler_of=HANDLERS.get) -> Policy:
    """The Policy katamgr webhook builds from the rendered Deployment's arguments (cmd_webhook),
    reading RuntimeClasses (--check-handlers) from ``handler_of``."""
    from katamgr.admission.rules import (
        DEFAULT_GPU_HANDLERS,
        DEFAULT_KATA_HANDLERS,
        DEFAULT_PASSTHROUGH,
        DEFAULT_RUNTIME_CLASSES,
    )
    from katamgr.cli import build_parser

    (c,) = rendered.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert args.check_handlers
    return Policy(runtime_classes=tuple(args.runtime_class or DEFAULT_RUNTIME_CLASSES),
                  passthrough=tuple(args.passthrough_resource or DEFAULT_PASSTHROUGH),
                  inject_runtime_class=args.inject_runtime_class,
                  confidential_classes=tuple(args.confidential_runtime_class or ()),
                  kata_handlers=tuple(args.kata_handler or DEFAULT_KATA_HANDLERS),
                  gpu_handlers=tuple(args.kata_gpu_handler or DEFAULT_GPU_HANDLERS),
                  handler_of=handler_of)


def included_cases() -> dict[str, dict]:
    c = podkit.container
    return {**podkit.cases(),
            "included-none": podkit.pod(c(limits={EDU: "1"})),
            "included-runc": podkit.pod(c(limits={"example.com/vga": "1"}), runtime_class="runc"),
            "included-init": podkit.pod(c(), init=[c("loader", limits={EDU: "1"})]),
            "included-0": podkit.pod(c(limits={EDU: "0"})),
            "included-kata": podkit.pod(c(limits={EDU: "1"}), runtime_class=podkit.KATA),
            "other-domain": podkit.pod(c(limits={"example.com/nic": "1"}))}


def test_included_resources_become_the_webhooks_passthrough_resources(chart):
    policy = webhook_policy(render(chart, merged(WEBHOOK, INCLUDED)))
    # isolation.passthroughResources first, then each included resource once.
    assert policy.passthrough == ("nvidia.com/*", EDU, "example.com/vga")
    assert validate(included_cases()["included-none"], policy) is not None
    assert validate(included_cases()["included-kata"], policy) is None
    # Listed by hand as well, it is passed once.
    both = render(chart, merged(WEBHOOK, INCLUDED, {"isolation": {"passthroughResources": [
        "nvidia.com/*", EDU]}}))
    assert webhook_policy(both).passthrough == ("nvidia.com/*", EDU, "example.com/vga")
    # Without devices.include, the chart's defaults as before.
    assert webhook_policy(render(chart, WEBHOOK)).passthrough == ("nvidia.com/*",)


@pytest.mark.parametrize("case", sorted(included_cases()))
def test_the_policy_cel_denies_an_included_resource_outside_kata(chart, case):
    rendered = render(chart, merged(WEBHOOK, POLICY, INCLUDED))
    obj = included_cases()[case]
    denials = admission(rendered, obj, CLUSTER)
    ok = not denials
    denial = validate(obj, webhook_policy(rendered))
    assert ok == (denial is None), (case, denials, denial)
    if case in ("included-none", "included-runc", "included-init"):
        assert not ok
        assert denials == [denial.split(": ", 1)[1]]
        assert "requests the passthrough resource example.com/" in denials[0]
    if case in ("included-0", "included-kata", "other-domain"):
        assert ok


def test_without_includes_the_policy_cel_is_as_before(chart):
    policy = render(chart, POLICY).get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    assert "example.com" not in str(policy)
    assert evaluate_policy(policy, included_cases()["included-none"]) == (True, None)


def test_the_policy_with_includes_is_valid_for_kubernetes(chart, kube_validate):
    policy = render(chart, merged(POLICY, INCLUDED)).get("ValidatingAdmissionPolicy",
                                                         "-passthrough-needs-kata")
    kube_validate.validate(policy, "1.33.0", strict=True)
    (passthrough,) = [v for v in policy["spec"]["variables"] if v["name"] == "passthrough"]
    assert passthrough["expression"].count('["example.com/edu","example.com/vga"]') == 2


def test_the_policy_binding(chart):
    rendered = render(chart, POLICY)
    binding = rendered.get("ValidatingAdmissionPolicyBinding", "-passthrough-needs-kata")
    assert binding["spec"]["policyName"] == RELEASE + "-passthrough-needs-kata"
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert excluded_namespaces(binding["spec"]["matchResources"]["namespaceSelector"]) == [
        NAMESPACE, "kube-system"]
    policy = rendered.get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    assert [(r["resources"], r["operations"]) for r in policy["spec"]["matchConstraints"]["resourceRules"]] == [
        (["pods"], ["CREATE"]), (["pods/ephemeralcontainers"], ["UPDATE"]), (["pods"], ["UPDATE"])]
    assert policy["spec"]["failurePolicy"] == "Fail"
    # The handler rule: every RuntimeClass a param, none at all is no reason to refuse.
    handler = rendered.get("ValidatingAdmissionPolicyBinding", "-kata-handler")
    assert handler["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
    assert handler["spec"]["matchResources"] == binding["spec"]["matchResources"]


# --- pods/ephemeralcontainers and the RuntimeClass handler, both layers alike ------------

EPHEMERAL_CASES = {
    "debug-plain": podkit.ephemeral(podkit.pod(podkit.container())),
    "debug-void": podkit.ephemeral(podkit.pod(podkit.container()), env={"NVIDIA_VISIBLE_DEVICES": "void"}),
    "debug-all": podkit.ephemeral(podkit.pod(podkit.container()), env={"NVIDIA_VISIBLE_DEVICES": "all"}),
    "debug-devlist": podkit.ephemeral(podkit.pod(podkit.container(), empty_dirs=("d",)),
                                      mounts={"d": "/var/run/nvidia-container-devices/all"}),
    # The rest of the pod is not looked at on the subresource: it could not change there.
    "debug-old-pod": podkit.ephemeral(podkit.cases()["sidecar-user-all"], env={"NVIDIA_VISIBLE_DEVICES": "void"}),
}


@pytest.mark.parametrize("case", sorted(EPHEMERAL_CASES))
def test_the_policy_cel_agrees_with_the_webhook_on_kubectl_debug(chart, case):
    policy = render(chart, POLICY).get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    obj = EPHEMERAL_CASES[case]
    ok, message = evaluate_policy(policy, obj, subresource="ephemeralcontainers")
    denial = validate(obj, Policy(), subresource="ephemeralcontainers")
    assert ok == (denial is None), (case, message, denial)
    assert ok == (case in ("debug-plain", "debug-void", "debug-old-pod"))
    if not ok:
        assert message == denial.split(": ", 1)[1] and "ephemeral container \"debugger\"" in message


RUNTIME_CLASSES = {"kata": {"metadata": {"name": podkit.KATA}, "handler": podkit.KATA},
                   "runc": {"metadata": {"name": podkit.KATA}, "handler": "runc"},
                   "other": {"metadata": {"name": "runc"}, "handler": "runc"}}


@pytest.mark.parametrize("param", sorted(RUNTIME_CLASSES))
@pytest.mark.parametrize("case", ["passthrough-kata", "kata-and-sidecar", "no-request", "gpu"])
def test_the_handler_policy_agrees_with_the_webhook(chart, case, param):
    policy = render(chart, POLICY).get("ValidatingAdmissionPolicy", "-kata-handler")
    rc = RUNTIME_CLASSES[param]
    ok, message = evaluate_policy(policy, podkit.cases()[case], params=rc)
    handlers = {rc["metadata"]["name"]: rc["handler"]}
    denial = validate(podkit.cases()[case], Policy(handler_of=handlers.get))
    assert ok == (denial is None), (case, param, message, denial)
    assert ok == (param != "runc" or case not in ("passthrough-kata", "kata-and-sidecar"))
    if not ok:
        assert message == denial.split(": ", 1)[1]



def test_values_without_an_isolation_block_render_none(chart):
    # As in helm upgrade --reuse-values from a release made before the isolation block:
    # null removes the chart's default block (Helm's rule), and nothing fails.
    kinds = kinds_of(render(chart, {"isolation": None}))
    assert kinds and not kinds & ISOLATION_KINDS


def test_the_escape_check_refuses_what_the_api_server_refused():
    assert not cel_escapes_ok("k.matches('^nvidia\\.com/')")  # as rendered before: refused for real
    assert cel_escapes_ok("k.matches('^nvidia\\\\.com/')")
