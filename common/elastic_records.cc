// Implementation of elastic_records.h.

#include "common/elastic_records.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/store_keys.h"
#include "google/protobuf/util/json_util.h"
#include "gradsync/v1/membership.pb.h"

namespace gradsync {

std::optional<std::string> ElasticRecordKind(absl::string_view key) {
  if (key == kElasticDecisionKey) return "decision";
  if (!absl::ConsumePrefix(&key, kElasticKeyPrefix)) return std::nullopt;
  if (absl::StartsWith(key, "ticket/")) return "ticket";
  if (absl::StartsWith(key, "admit/")) return "admission";
  return std::nullopt;
}

absl::StatusOr<std::string> ElasticRecordJson(absl::string_view kind, absl::string_view record) {
  v1::MembershipDecision decision;
  v1::JoinTicket ticket;
  v1::JoinAdmission admission;
  google::protobuf::Message* message = nullptr;
  bool set = false;  // daemons write every record with its defining field set
  if (kind == "decision") {
    message = &decision;
  } else if (kind == "ticket") {
    message = &ticket;
  } else if (kind == "admission") {
    message = &admission;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("record kind '", kind, "': decision, ticket or admission"));
  }
  if (record.size() <= (size_t{1} << 20) &&
      message->ParseFromArray(record.data(), static_cast<int>(record.size()))) {
    set = message == &decision    ? decision.epoch() > 0
          : message == &admission ? admission.epoch() > 0
                                  : ticket.state() != v1::JoinTicket::STATE_UNSPECIFIED;
  }
  if (!set) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a ", kind, " record (", record.size(), " bytes)"));
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  if (auto s = google::protobuf::util::MessageToJsonString(*message, &json, options); !s.ok()) {
    return absl::InternalError(std::string(s.message()));
  }
  return json;
}

}  // namespace gradsync
