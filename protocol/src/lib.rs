//! Switchyard's wire contract.
//!
//! The only crate whose types are `Serialize`: block hashing ([`hash`]),
//! identifiers ([`ids`]), the messages workers, indexer and routers exchange,
//! the codec every message goes through ([`codec`]) and the names of every
//! subject, stream and key ([`subjects`]).

pub mod codec;
pub mod decision;
pub mod decision_log;
pub mod events;
pub mod fragment;
pub mod generate;
pub mod hash;
pub mod ids;
pub mod index;
pub mod presence;
pub mod registry;
pub mod replay;
pub mod subjects;
pub mod trace;

pub use codec::{DecodeError, Message};
pub use decision::{Annotation, Path, PrefixFetch, RouteDecision};
pub use decision_log::{
    CandidateFacts, CandidateState, Columns, ContextId, DecisionContext, LogEntry, LogReader,
    LogWriter, LoggedDecision, LoggedPrompt, PackedHashes, PrefixRef, PromptRecord, ResolveError,
    WriterLimits,
};
pub use events::{KvEvent, KvEventBatch, LoadReport, Tier, TierSet};
pub use fragment::{Reassembly, RequestFragment};
pub use generate::{
    CancelRequest, FinishReason, GenerateChunk, GenerateEvent, GenerateRequest, KvHandle,
    KvHandleQuery, KvHandleReply, KvTransferParams, LegProbe, LegProbeReply, OverlapQuery,
    OverlapReply, Progress, RequestProgress, ResyncReply, Sampling, Stage, TokenLogprob,
    WorkerOverlap,
};
pub use hash::{BlockHasher, HashSalt, HASH_SCHEME};
pub use ids::{BlockHash, DecisionId, InvalidSessionId, SessionId, WorkerId};
pub use index::{IndexChange, IndexDelta, IndexSnapshot, OwnedRun, RunOwner, WorkerCursor};
pub use presence::{Presence, RouterHeartbeat};
pub use registry::{
    Capabilities, ContractMismatch, HashingContract, Role, WorkerRecord, WorkerSubjects,
};
pub use replay::{
    CandidateInput, CandidateLoad, DecisionInputs, DecisionRecord, IndexStatus, SessionInput,
};
