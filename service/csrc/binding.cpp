// Python binding of the drafter core (module samrollout._sam_core).
//
// Arrays cross the boundary without copies (nanobind ndarrays, C-contiguous,
// exact dtypes) and every call that touches automata releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <limits>
#include <cstdint>
#include <string>
#include <vector>
#include <stdexcept>

#include "drafter.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using samrollout::Drafter;

namespace {

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using IdArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DraftOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using LengthOut = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Reads a Python sequence of integers into `out` (ints, numpy integers: anything with
// __index__), rejecting values that do not fit T.
template <typename T>
void read_ints(PyObject* seq, std::vector<T>& out, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) throw nb::python_error();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long value = PyLong_AsLongLong(items[i]);
    if (value == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      throw nb::python_error();
    }
    if (value < std::numeric_limits<T>::min() || value > std::numeric_limits<T>::max()) {
      Py_DECREF(fast);
      throw std::invalid_argument(std::string(what) + " holds token id " + std::to_string(value) +
                                  ", outside any vocabulary");
    }
    out.push_back(static_cast<T>(value));
  }
  Py_DECREF(fast);
}

// The engine-shaped step: request handles and per-row token lists in, per-row draft lists out.
nb::list step_lists(Drafter& d, nb::handle requests, nb::handle rows_tokens, int32_t k) {
  std::vector<int32_t> flat;
  std::vector<int64_t> handles;
  std::vector<int64_t> offsets{0};
  read_ints(requests.ptr(), handles, "requests must be a sequence of handles");
  PyObject* rows = PySequence_Fast(rows_tokens.ptr(), "tokens must be a sequence of token sequences");
  if (rows == nullptr) throw nb::python_error();
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(rows);
  if (static_cast<std::size_t>(count) != handles.size()) {
    Py_DECREF(rows);
    throw std::invalid_argument("requests and tokens must have the same length");
  }
  try {
    for (Py_ssize_t i = 0; i < count; ++i) {
      read_ints(PySequence_Fast_GET_ITEM(rows, i), flat, "each row of tokens must be a sequence of ints");
      offsets.push_back(static_cast<int64_t>(flat.size()));
    }
  } catch (...) {
    Py_DECREF(rows);
    throw;
  }
  Py_DECREF(rows);
  const std::size_t n = handles.size();
  const std::size_t width = k > 0 ? static_cast<std::size_t>(k) : 0;
  std::vector<int32_t> drafts(n * width + 1);
  std::vector<int32_t> lengths(n + 1);
  {
    nb::gil_scoped_release release;
    d.step(handles.data(), n, flat.data(), offsets.data(), k, drafts.data(), lengths.data());
  }
  nb::list out;
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* row = PyList_New(lengths[i]);
    if (row == nullptr) throw nb::python_error();
    for (int32_t j = 0; j < lengths[i]; ++j) {
      PyList_SET_ITEM(row, j, PyLong_FromLong(drafts[i * width + static_cast<std::size_t>(j)]));
    }
    out.append(nb::steal(row));
  }
  return out;
}

// One int32 per request from a const Drafter query (last_match_lengths, last_sources), as a list.
nb::list per_request(const Drafter& d, nb::handle requests,
                     void (Drafter::*query)(const int64_t*, std::size_t, int32_t*) const) {
  std::vector<int64_t> handles;
  read_ints(requests.ptr(), handles, "requests must be a sequence of handles");
  std::vector<int32_t> values(handles.size());
  {
    nb::gil_scoped_release release;
    (d.*query)(handles.data(), handles.size(), values.data());
  }
  nb::list out;
  for (int32_t value : values) out.append(value);
  return out;
}

}  // namespace

NB_MODULE(_sam_core, m) {
  m.doc() = "Native suffix-automaton drafter core of samrollout.";
  m.attr("MAX_DRAFT_TOKENS") = Drafter::kMaxDraftTokens;
  m.attr("MAX_FALLBACK_HOPS") = samrollout::Automaton::kMaxFallbackHops;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  nb::class_<Drafter>(m, "Core")
      .def(
          "__init__",
          [](Drafter* self, int32_t vocab_size, int32_t min_match_length, double match_scale,
             int32_t occurrence, int32_t source, int32_t group_margin, int64_t max_request_tokens,
             int64_t max_group_tokens, int64_t max_global_tokens, int32_t global_margin, double min_probability) {
            samrollout::DraftPolicy policy;
            policy.vocab_size = vocab_size;
            policy.min_match_length = min_match_length;
            policy.match_scale = match_scale;
            policy.occurrence = static_cast<samrollout::Occurrence>(occurrence);
            policy.source = static_cast<samrollout::Source>(source);
            policy.group_margin = group_margin;
            policy.max_request_tokens = max_request_tokens;
            policy.max_group_tokens = max_group_tokens;
            policy.max_global_tokens = max_global_tokens;
            policy.global_margin = global_margin;
            policy.min_probability = min_probability;
            new (self) Drafter(policy);
          },
          "vocab_size"_a, "min_match_length"_a, "match_scale"_a, "occurrence"_a, "source"_a, "group_margin"_a,
          "max_request_tokens"_a, "max_group_tokens"_a, "max_global_tokens"_a = 0, "global_margin"_a = 4,
          "min_probability"_a = 0.0)
      .def(
          "add_request",
          [](Drafter& d, int64_t request, TokenArray prompt, int64_t group) {
            nb::gil_scoped_release release;
            return d.add_request(request, prompt.data(), prompt.shape(0), group);
          },
          "request"_a, "prompt"_a.noconvert(), "group"_a)
      .def(
          "append",
          [](Drafter& d, int64_t request, TokenArray tokens) {
            nb::gil_scoped_release release;
            d.append(request, tokens.data(), tokens.shape(0));
          },
          "request"_a, "tokens"_a.noconvert())
      .def(
          "propose",
          [](Drafter& d, int64_t request, int32_t k) {
            int32_t out[Drafter::kMaxDraftTokens];
            int32_t n = 0;
            {
              nb::gil_scoped_release release;
              n = d.propose(request, k, out);
            }
            nb::list draft;
            for (int32_t i = 0; i < n; ++i) draft.append(out[i]);
            return draft;
          },
          "request"_a, "k"_a)
      .def(
          "step",
          [](Drafter& d, IdArray requests, TokenArray tokens, IdArray offsets, int32_t k, DraftOut drafts,
             LengthOut lengths) {
            const std::size_t rows = requests.shape(0);
            if (offsets.shape(0) != rows + 1) {
              throw std::invalid_argument("offsets must have one entry more than requests");
            }
            if (offsets.data()[rows] != static_cast<int64_t>(tokens.shape(0))) {
              throw std::invalid_argument("offsets[-1] must equal the number of tokens");
            }
            if (drafts.shape(0) < rows || static_cast<int64_t>(drafts.shape(1)) != k || lengths.shape(0) < rows) {
              throw std::invalid_argument("output arrays must be [rows, k] and [rows]");
            }
            nb::gil_scoped_release release;
            d.step(requests.data(), rows, tokens.data(), offsets.data(), k, drafts.data(), lengths.data());
          },
          "requests"_a.noconvert(), "tokens"_a.noconvert(), "offsets"_a.noconvert(), "k"_a,
          "drafts"_a.noconvert(), "lengths"_a.noconvert())
      .def("step_lists", &step_lists, "requests"_a, "tokens"_a, "k"_a,
           "Append each row's tokens and return each row's draft, as lists (vLLM's proposer shape).")
      .def(
          "remove_request",
          [](Drafter& d, int64_t request) {
            nb::gil_scoped_release release;
            d.remove_request(request);
          },
          "request"_a)
      .def(
          "add_to_group",
          [](Drafter& d, int64_t group, TokenArray tokens) {
            nb::gil_scoped_release release;
            return d.add_to_group(group, tokens.data(), tokens.shape(0));
          },
          "group"_a, "tokens"_a.noconvert())
      .def(
          "add_to_global",
          [](Drafter& d, TokenArray tokens) {
            nb::gil_scoped_release release;
            return d.add_to_global(tokens.data(), tokens.shape(0));
          },
          "tokens"_a.noconvert())
      .def(
          "response",
          [](const Drafter& d, int64_t request) {
            std::vector<int32_t> tokens;
            {
              nb::gil_scoped_release release;
              tokens = d.response(request);
            }
            auto* data = new std::vector<int32_t>(std::move(tokens));
            nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
            return nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(data->data(), {data->size()}, owner);
          },
          "request"_a)
      .def(
          "last_match_lengths",
          [](const Drafter& d, nb::handle requests) { return per_request(d, requests, &Drafter::last_match_lengths); },
          "requests"_a)
      .def(
          "last_sources",
          [](const Drafter& d, nb::handle requests) { return per_request(d, requests, &Drafter::last_sources); },
          "requests"_a)
      .def("has_request", &Drafter::has_request, "request"_a)
      .def(
          "info",
          [](const Drafter& d, int64_t request) {
            const samrollout::RequestInfo i = d.info(request);
            nb::dict out;
            out["num_tokens"] = i.num_tokens;
            out["match_length"] = i.match_length;
            out["own_overflow"] = i.own_overflow;
            out["group_overflow"] = i.group_overflow;
            out["group"] = i.group;
            return out;
          },
          "request"_a)
      .def_prop_ro("num_requests", &Drafter::num_requests)
      .def_prop_ro("num_groups", &Drafter::num_groups)
      .def_prop_ro("global_tokens", &Drafter::global_tokens)
      .def("memory_bytes", &Drafter::memory_bytes);
}
