"""Compatibility verdict of an archived model against the running environment.

One function, :func:`assess`, and one data structure, :class:`Verdict`, used by ``load_model``,
the pyfunc loader and the ``jaxexp check`` command. The verdict is reached *before* anything is
compiled or called, from the MLmodel ``jaxexp`` section (and, when given, the blob's own
description from the jax-free reader) and a snapshot of the running environment
(:class:`Environment`). Checks, each giving a :class:`Reason` with a ``code``:

``platform``            the running platform is not among the exported ``platforms``
``devices``             fewer devices visible than the export's ``nr_devices``
``calling_convention``  the blob's calling convention is outside what the running jax reads
``schema``              the blob was written with a newer serialization schema than jax reads
``expired``             jax >= 0.11.1 refuses blobs of schema < 5 (written by jax <= 0.7) unless
                        its flag ``jax_export_deserialize_expired_versions`` is set
``hlo_sharding``        jax >= 0.11.1 refuses blobs carrying old-style (HLO) shardings, flag or not
``window_backward``     exporter's jaxlib built more than 6 months before the running one (a
                        warning: no released jax refuses a blob by its date, see ``expired``)
``window_forward``      exporter's jaxlib built more than 3 weeks after the running one
``jaxlib_unknown``      a jaxlib version the shipped release table does not know
``custom_calls``        custom-call targets of the module the running jaxlib does not register
``kernel_abi``          a registered kernel called with a signature (operand/result count) the
                        running jax no longer runs (it fails at execution); a warning when the
                        calls cannot be read and only dates suggest it

Kernel signatures and what each jax release runs come from ``jaxexp_mlflow/data/kernel_abi.json``,
derived from the history of JAX's own back-compat test data (regenerate with
``scripts/update_kernel_abi.py``); the same table records whether a release enforces its stated
calling-convention range when reading (none does so far: an older convention only warns).

JAX's promise (https://docs.jax.dev/en/latest/export/export.html#compatibility-guarantees) is
stated between the *build dates* of the exporting and the consuming jaxlib; the dates come from
``jaxexp_mlflow/data/jaxlib_releases.json`` (regenerate with
``scripts/update_jaxlib_releases.py``). Bare blobs (logged as bytes) carry no jaxlib version:
their build date is bracketed from what the blob itself says (serialization schema, calling
convention, the serialization version field).
"""

from jaxexp_mlflow.codec.schema import (
    BREAKING_SCHEMAS,
    CALLING_CONVENTION_WRITTEN_UNTIL,
    ENFORCING_JAX,
    OLDEST_SCHEMA_READ_BY_ENFORCING_JAX,
    SCHEMA_DATES,
    SERIALIZATION_FIELD_WRITTEN_FROM,
    SERIALIZATION_FIELD_WRITTEN_UNTIL,
)
from jaxexp_mlflow.runtime import stablehlo_ops
from jaxexp_mlflow.runtime.compat.assess import assess
from jaxexp_mlflow.runtime.compat.calls import (
    BUILTIN_TARGETS,
    judge_custom_calls,
    judge_kernel_abi,
    module_targets,
    target_platform,
)
from jaxexp_mlflow.runtime.compat.environment import (
    EXPIRED_ENV,
    EXPIRED_FLAG,
    Environment,
    coerce_environment,
    registered_custom_call_targets,
)
from jaxexp_mlflow.runtime.compat.releases import (
    _releases,
    calling_convention_enforced,
    exporter_dates,
    iso_date,
    kernel_abi_table,
    kernel_signatures,
    newest_release_before,
    oldest_release_after,
    release_date,
    release_table,
    version_key,
)
from jaxexp_mlflow.runtime.compat.verdict import (
    INCOMPATIBLE,
    OK,
    SEVERITY_RANK,
    WARN,
    Reason,
    Verdict,
)
from jaxexp_mlflow.runtime.compat.window import (
    BACKWARD_WINDOW,
    FORWARD_WINDOW,
    hlo_shardings,
    judge_window,
    window_closes,
)

#: every name ``compat.X`` gave before the split (so ruff keeps these imports)
__all__ = [
    "OK",
    "WARN",
    "INCOMPATIBLE",
    "SEVERITY_RANK",
    "Reason",
    "Verdict",
    "release_table",
    "kernel_abi_table",
    "kernel_signatures",
    "calling_convention_enforced",
    "version_key",
    "release_date",
    "_releases",
    "newest_release_before",
    "oldest_release_after",
    "exporter_dates",
    "iso_date",
    "EXPIRED_FLAG",
    "EXPIRED_ENV",
    "Environment",
    "registered_custom_call_targets",
    "coerce_environment",
    "BACKWARD_WINDOW",
    "FORWARD_WINDOW",
    "judge_window",
    "hlo_shardings",
    "window_closes",
    "BUILTIN_TARGETS",
    "target_platform",
    "module_targets",
    "judge_custom_calls",
    "judge_kernel_abi",
    "assess",
    "BREAKING_SCHEMAS",
    "CALLING_CONVENTION_WRITTEN_UNTIL",
    "ENFORCING_JAX",
    "OLDEST_SCHEMA_READ_BY_ENFORCING_JAX",
    "SCHEMA_DATES",
    "SERIALIZATION_FIELD_WRITTEN_FROM",
    "SERIALIZATION_FIELD_WRITTEN_UNTIL",
    "stablehlo_ops",
]

_vkey = version_key  # its old private name, used as compat._vkey
