// Python binding of the drafter core (module samrollout._sam_core).
//
// Arrays cross the boundary without copies (nanobind ndarrays, C-contiguous,
// exact dtypes) and every call that touches automata releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>

#include "drafter.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using samrollout::Drafter;

namespace {

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using IdArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutArray = nb::ndarray<nb::numpy, int32_t>;
using DraftOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using LengthOut = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

OutArray owned_array(int32_t* data, std::initializer_list<std::size_t> shape) {
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return OutArray(data, shape, owner);
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
             int32_t occurrence, int32_t source, int64_t max_request_tokens, int64_t max_group_tokens) {
            samrollout::DraftPolicy policy;
            policy.vocab_size = vocab_size;
            policy.min_match_length = min_match_length;
            policy.match_scale = match_scale;
            policy.occurrence = static_cast<samrollout::Occurrence>(occurrence);
            policy.source = static_cast<samrollout::Source>(source);
            policy.max_request_tokens = max_request_tokens;
            policy.max_group_tokens = max_group_tokens;
            new (self) Drafter(policy);
          },
          "vocab_size"_a, "min_match_length"_a, "match_scale"_a, "occurrence"_a, "source"_a,
          "max_request_tokens"_a, "max_group_tokens"_a)
      .def(
          "add_request",
          [](Drafter& d, int64_t request, TokenArray prompt, int64_t group) {
            nb::gil_scoped_release release;
            d.add_request(request, prompt.data(), prompt.shape(0), group);
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
            auto* out = new int32_t[Drafter::kMaxDraftTokens];
            int32_t n = 0;
            try {
              nb::gil_scoped_release release;
              n = d.propose(request, k, out);
            } catch (...) {
              delete[] out;
              throw;
            }
            return owned_array(out, {static_cast<std::size_t>(n)});
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
      .def(
          "remove_request",
          [](Drafter& d, int64_t request) {
            nb::gil_scoped_release release;
            d.remove_request(request);
          },
          "request"_a)
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
      .def("memory_bytes", &Drafter::memory_bytes);
}
